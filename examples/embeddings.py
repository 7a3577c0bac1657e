"""Text embeddings from a pooling model.

Deploys ``embed`` (an embedding model runs with vLLM's ``runner="pooling"``, chosen from its
architecture; ``max_output_prompt_length`` is 0 because it generates nothing), embeds a few
sentences with ``client.embeddings.create`` and prints the most similar pair by cosine
similarity. The sim engine returns hash-derived vectors, so its similarities mean nothing.

    export HIVE_URL=http://head:8000 HIVE_ADMIN_TOKEN=... HIVE_API_KEY=...
    python examples/embeddings.py --model sentence-transformers/all-MiniLM-L6-v2
    python examples/embeddings.py --model /models/minilm --engine sim
"""

from __future__ import annotations

from itertools import combinations

from _hive import deployed, openai_client, parser

SENTENCES = ["The cat sits on the mat.", "A kitten rests on a rug.", "GPUs multiply matrices quickly."]


def cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b))
    return dot / ((sum(x * x for x in a) ** 0.5) * (sum(y * y for y in b) ** 0.5))


def main() -> None:
    p = parser(__doc__)
    p.set_defaults(model="sentence-transformers/all-MiniLM-L6-v2")
    p.add_argument("--use", metavar="MODEL_ID", help="a deployed embedding model instead of deploying one")
    args = p.parse_args()
    model_id = args.use or "embed"
    with deployed(args, model_id, max_output_prompt_length=0) as st:
        if st is not None:
            print(f"embed: {st['status']} on {[r['devices'] for r in st['replicas'].values()]}")
        out = openai_client().embeddings.create(model=model_id, input=SENTENCES)
        vecs = [d.embedding for d in out.data]
        print(f"embedded {len(vecs)} sentences, dim={len(vecs[0])}, {out.usage.prompt_tokens} tokens")
        i, j = max(combinations(range(len(vecs)), 2), key=lambda ij: cosine(vecs[ij[0]], vecs[ij[1]]))
        print(f"most similar: {SENTENCES[i]!r} ~ {SENTENCES[j]!r} (cosine {cosine(vecs[i], vecs[j]):.3f})")


if __name__ == "__main__":
    main()
