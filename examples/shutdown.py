"""Shut down every model the hive serves (or the ones named).

DELETE /admin/models drains: in-flight requests finish (at most HIVE_DRAIN_GRACE_S), then each
model's apps are removed and its GPU memory released. The hive's own control plane keeps
running (``serve shutdown`` or ``ray stop`` on the cluster end that).

    export HIVE_URL=http://head:8000 HIVE_ADMIN_TOKEN=...
    python examples/shutdown.py              # every model
    python examples/shutdown.py qwen3 embed  # just these
"""

from __future__ import annotations

from _hive import admin, check, parser


def main() -> None:
    p = parser(__doc__, model=False)
    p.add_argument("model_ids", nargs="*", help="models to delete (default: all)")
    args = p.parse_args()
    hive = admin()
    before = [m["model_id"] for m in check(hive.get("/models"))["models"]]
    print(f"serving: {before or 'nothing'}")
    if args.model_ids:
        for model_id in args.model_ids:
            r = hive.delete(f"/models/{model_id}")
            print(f"{model_id}: {r.status_code} {r.json()}")
    else:
        r = hive.delete("/models")
        print(f"DELETE /admin/models: {r.status_code} {check(r)}")
    left = [m["model_id"] for m in check(hive.get("/models"))["models"]]
    reserved = sum(d["reserved_bytes"] for d in check(hive.get("/gpus"))["devices"])
    print(f"left: {left or 'nothing'}; reserved on all devices: {reserved} bytes")


if __name__ == "__main__":
    main()
