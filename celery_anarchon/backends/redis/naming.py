"""Key names of the Redis backend: every key of a job carries the hash tag
``{PJ}``, the registry's ``{P}``, so each script touches one cluster slot."""

from __future__ import annotations

from ..base import LeaseBackend


class RedisNaming(LeaseBackend):
    """The keys under ``self.prefix``."""

    #: the key prefix ``P`` (default ``"anarchon:"``)
    prefix: str

    def _tag(self, job: str) -> str:
        return "{" + self.prefix + job + "}"

    def _runs_key(self, job: str) -> str:
        return f"{self._tag(job)}:runs"

    def _slot_keys(self, job: str, slot_ms: int) -> list[str]:
        tag = self._tag(job)
        return [f"{tag}:slot:{slot_ms}", f"{tag}:runs", f"{tag}:index"]

    def _won_key(self, job: str) -> str:
        """The job's count of won claims (a run limit's count, kept for good)."""
        return f"{self._tag(job)}:won"

    def _registry_key(self) -> str:
        return "{" + self.prefix + "}:instances"

    def _instance_key(self, instance: str) -> str:
        return "{" + self.prefix + "}:instance:" + instance
