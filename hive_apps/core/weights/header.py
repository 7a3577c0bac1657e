"""The header of one safetensors file of a source, read without its tensors: names, dtypes and shapes.

A safetensors file starts with 8 bytes (the header's length, little-endian) and the header's JSON. A
LoRA adapter is checked against its base before anything is loaded (``core/planning/lora.py``):
the shapes say which hidden size and which modules it was made for. Read in place from a folder, and
with two ranged requests from the Hub (the header's length, then the header) or S3, so a large file
is never downloaded to be checked. No Ray here.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from hive_apps.core.weights.clients import hub_endpoint, hub_online, hub_token, s3_client, s3_location
from hive_apps.core.weights.types import Manifest, SourceError, SourceKind

MAX_HEADER_BYTES = 100 * 2**20  # what the safetensors format itself allows
HUB_TIMEOUT_S = 30.0


class TensorInfo(BaseModel):
    """One tensor as its file's header describes it."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    dtype: str
    shape: tuple[int, ...]


def parse_header(raw: bytes, where: str) -> dict[str, TensorInfo]:
    """Tensor name -> dtype and shape, from a header's JSON (``__metadata__`` left out). ``SourceError``
    (422) naming ``where`` when it is not a safetensors header."""
    try:
        body = json.loads(raw)
        if not isinstance(body, dict):
            raise ValueError("the header is not a JSON object")
        return {name: TensorInfo.model_validate(info) for name, info in body.items() if name != "__metadata__"}
    except (ValueError, ValidationError, RecursionError) as e:
        raise SourceError(f"{where} is not a safetensors file: its header does not parse ({str(e).splitlines()[0]})",
                          422) from None


def header_length(first: bytes, where: str) -> int:
    if len(first) < 8:
        raise SourceError(f"{where} is not a safetensors file: shorter than its 8-byte header length", 422)
    n = int(struct.unpack("<Q", first[:8])[0])
    if not 2 <= n <= MAX_HEADER_BYTES:
        raise SourceError(f"{where} is not a safetensors file: a header of {n} bytes", 422)
    return n


def read_header(manifest: Manifest, path: str) -> dict[str, TensorInfo]:
    """The header of the file ``path`` of the source, at the manifest's revision."""
    where = f"{manifest.source}: {path}"
    kind = manifest.source.kind
    if kind is SourceKind.LOCAL:
        return parse_header(_local_range(Path(manifest.source.location) / path, where), where)
    read = _hub_range if kind is SourceKind.HUB else _s3_range
    n = header_length(read(manifest, path, 0, 8), where)
    raw = read(manifest, path, 8, 8 + n)
    if len(raw) != n:
        raise SourceError(f"{where} is not a safetensors file: its {n}-byte header is cut short", 422)
    return parse_header(raw, where)


def _local_range(file: Path, where: str) -> bytes:
    try:
        with open(file, "rb") as f:
            n = header_length(f.read(8), where)
            return f.read(n)
    except OSError as e:
        raise SourceError(f"{where} cannot be read: {e.strerror or e}", 422) from None


def _hub_range(manifest: Manifest, path: str, start: int, end: int) -> bytes:
    from huggingface_hub import hf_hub_url
    from huggingface_hub.utils import build_hf_headers, get_session

    from hive_apps.core.weights.listing import hub_errors

    url = hf_hub_url(manifest.source.location, path, revision=manifest.revision, endpoint=hub_endpoint())
    headers = {**build_hf_headers(token=hub_token() or False), "Range": f"bytes={start}-{end - 1}"}
    with hub_errors(manifest.source, path), hub_online():  # online in this thread only, as the listing is
        resp = get_session().get(url, headers=headers, follow_redirects=True, timeout=HUB_TIMEOUT_S)
        resp.raise_for_status()
    return _exact(resp.content, start, end, resp.status_code, f"{manifest.source}: {path}")


def _s3_range(manifest: Manifest, path: str, start: int, end: int) -> bytes:
    from hive_apps.core.weights.listing import s3_errors

    bucket, prefix = s3_location(manifest.source)
    with s3_errors(manifest.source):
        body: Any = s3_client(retries=True).get_object(Bucket=bucket, Key=prefix + path, Range=f"bytes={start}-{end - 1}")
        data = body["Body"].read()
    return _exact(data, start, end, 206, f"{manifest.source}: {path}")


def _exact(data: bytes, start: int, end: int, status: int, where: str) -> bytes:
    """The asked-for range of a ranged answer (a server that ignores Range answers 200 with the whole
    file); shorter when the file ends first (the caller says what that means)."""
    if status == 200 and len(data) > end - start:
        data = data[start:end]
    if len(data) > end - start:
        raise SourceError(f"{where}: asked for bytes {start}-{end - 1}, got {len(data)} bytes", 502)
    return data
