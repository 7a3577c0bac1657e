"""Reading a deploy's ``model`` string as a weight source. Pure: no network, no Ray. The string is
checked here, before anything is listed, so a typo is a 422 that says how to write each form
rather than a confusing answer from a remote service."""

from __future__ import annotations

import os
import re

from hive_apps.core.weights.types import SourceError, SourceKind, WeightSource

FORMS = ("a Hugging Face Hub repo 'org/name' or 'org/name@revision' (a branch, tag or 40-hex commit), "
         "'s3://bucket/prefix', or a folder on the nodes: an absolute path ('/models/qwen3'), '~/...' or './...'")

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://(.*)$", re.DOTALL)
# The Hub's own rule (huggingface_hub's validate_repo_id): word characters, '-' and '.', not at
# either end, at most 96 each, no '--' or '..', not ending in '.git'.
_REPO_PART = r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]{0,94}[A-Za-z0-9_])?"
_REPO_ID = re.compile(rf"^(?:{_REPO_PART}/)?{_REPO_PART}$")
# A git ref name (branch or tag) or a commit: no spaces, no '..', no '//', no '~^:?*[\', no '@{'.
_REVISION = re.compile(r"^[A-Za-z0-9_](?:[A-Za-z0-9_./-]{0,254})$")
_BUCKET = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{1,254}$")


def parse_source(model: str) -> WeightSource:
    """The weight source a ``model`` string names; ``SourceError`` (422) when it names none."""
    text = model.strip()
    if not text:
        raise SourceError(f"model is empty: write {FORMS}", 422)
    scheme = _SCHEME.match(text)
    if scheme:
        if scheme[1].lower() != "s3":
            raise SourceError(f"model {model!r}: scheme '{scheme[1]}://' is not a weight source; write {FORMS}", 422)
        return _s3(model, scheme[2])
    if text.startswith(("/", "~", "./")):
        return _local(model, text)
    return _hub(model, text)


def _s3(model: str, rest: str) -> WeightSource:
    bucket, _, prefix = rest.partition("/")
    if not _BUCKET.match(bucket):
        raise SourceError(f"model {model!r}: an S3 source is 's3://bucket/prefix' and needs a valid bucket name", 422)
    prefix = prefix.strip("/")
    return WeightSource(kind=SourceKind.S3, location=f"{bucket}/{prefix}" if prefix else bucket)


def _local(model: str, text: str) -> WeightSource:
    if ".." in text.replace("\\", "/").split("/"):
        raise SourceError(f"model {model!r}: a local folder may not contain '..'; write it as an absolute path", 422)
    path = os.path.expanduser(text)
    if path.startswith("~"):
        raise SourceError(f"model {model!r}: '{text.split('/')[0]}' is not a user on the planner's node", 422)
    return WeightSource(kind=SourceKind.LOCAL, location=os.path.abspath(path))


def _hub(model: str, text: str) -> WeightSource:
    repo_id, at, revision = text.partition("@")
    if not _REPO_ID.match(repo_id) or "--" in repo_id or ".." in repo_id or repo_id.endswith(".git"):
        raise SourceError(f"model {model!r} is not a weight source: write {FORMS}. A Hub repo id uses letters, "
                          "digits, '-', '_' and '.' (not at either end, no '--' or '..')", 422)
    if at and not _valid_revision(revision):
        raise SourceError(f"model {model!r}: revision {revision!r} is not a branch, tag or commit name "
                          "(letters, digits, '-', '_', '.', '/'; no '..')", 422)
    return WeightSource(kind=SourceKind.HUB, location=repo_id, revision=revision or None)


def _valid_revision(revision: str) -> bool:
    return (bool(_REVISION.match(revision)) and ".." not in revision and "//" not in revision
            and not revision.endswith(("/", ".", ".lock")))
