"""What failed, where: the record every rank of a distributed pipe names, and the error it
raises; records travel through the store sealed under a token only the ranks share, each
bound to the key it was written under (so a record copied to another key is not taken)."""

from __future__ import annotations

import hashlib
import hmac
import json
import re
from dataclasses import asdict, dataclass

from gpipe.runtime.transport import Aborted

__all__ = ["Failure", "PipelineFailure", "brief", "opened", "sealed", "signed", "verified"]

# gloo's "[path/file.cc:123] " before its message
_SOURCE_LINE = re.compile(r"^\[[^\]]*:\d+\] ")


def brief(error: BaseException) -> str:
    """A torch.distributed error in one short clause, for a failure's one line: its first
    sentence, without gloo's source line before it and its advice after."""
    text = str(error).splitlines()[0] if str(error) else type(error).__name__
    return _SOURCE_LINE.sub("", text).split(". ")[0]


@dataclass(frozen=True)
class Failure:
    """What failed, where: enough for every rank to say it in one line."""

    rank: int
    error: str
    stage: int | None = None
    microbatch: int | None = None
    action: str | None = None

    def describe(self) -> str:
        if self.rank < 0:
            return self.error
        where = f"rank {self.rank}"
        if self.action is not None:
            where += f" (stage {self.stage}, micro-batch {self.microbatch}, action {self.action})"
        return f"{where} failed: {self.error}"


class PipelineFailure(Aborted, RuntimeError):
    """Raised on every rank of a distributed pipe when one rank fails or vanishes.

    It is an :class:`~gpipe.runtime.transport.Aborted`: a worker that meets it stops as it
    would for a failure of another worker in its own process.

    Attributes:
        failure: what failed, on which rank, stage, micro-batch and action.
    """

    def __init__(self, failure: Failure, seen_by: int) -> None:
        super().__init__(f"gpipe: {failure.describe()} [seen by rank {seen_by}]")
        self.failure = failure


def sealed(body: str, key: str, token: bytes) -> bytes:
    """``body`` as the store keeps it under ``key``: the text and its MAC under ``token``."""
    return json.dumps({"body": body, "mac": _mac(key, body, token)}).encode()


def opened(payload: bytes, key: str, token: bytes) -> str | None:
    """The text :func:`sealed` put in ``payload`` for ``key``; None if its MAC is not
    ``token``'s for that key (forged, or copied from another key)."""
    try:
        record = json.loads(payload.decode())
        body, mac = record["body"], record["mac"]
        if isinstance(body, str) and hmac.compare_digest(str(mac), _mac(key, body, token)):
            return body
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        pass
    return None


def signed(failure: Failure, key: str, token: bytes) -> bytes:
    """``failure`` as the store keeps it under ``key``: its fields, sealed."""
    return sealed(json.dumps(asdict(failure), sort_keys=True), key, token)


def verified(payload: bytes, key: str, token: bytes) -> Failure | None:
    """The failure in ``payload`` (read from ``key``), or None if it is not sealed under
    ``token`` for that key (a forged record)."""
    body = opened(payload, key, token)
    if body is None:
        return None
    try:
        return Failure(**json.loads(body))
    except (ValueError, TypeError):
        return None


def _mac(key: str, body: str, token: bytes) -> str:
    return hmac.new(token, f"{key}\n{body}".encode(), hashlib.sha256).hexdigest()
