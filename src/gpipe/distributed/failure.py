"""What failed, where: the record every rank of a distributed pipe names, and the error it
raises; records travel through the store signed under a token only the ranks share."""

from __future__ import annotations

import hashlib
import hmac
import json
import re
from dataclasses import asdict, dataclass

from gpipe.runtime.transport import Aborted

__all__ = ["Failure", "PipelineFailure", "brief", "signed", "verified"]

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


def signed(failure: Failure, token: bytes) -> bytes:
    """``failure`` as the store keeps it: its fields and their MAC under ``token``."""
    body = json.dumps(asdict(failure), sort_keys=True)
    return json.dumps({"failure": body, "mac": _mac(body, token)}).encode()


def verified(payload: bytes, token: bytes) -> Failure | None:
    """The failure in ``payload``, or None if its MAC is not ``token``'s (a forged record)."""
    try:
        record = json.loads(payload.decode())
        body, mac = record["failure"], record["mac"]
        if not hmac.compare_digest(mac, _mac(body, token)):
            return None
        return Failure(**json.loads(body))
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        return None


def _mac(body: str, token: bytes) -> str:
    return hmac.new(token, body.encode(), hashlib.sha256).hexdigest()
