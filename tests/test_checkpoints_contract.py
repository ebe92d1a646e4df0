"""The checkpoint contract (docs/backends.md, "Checkpoints"): its artifacts round-trip through JSON, and which
backends say they can keep checkpoints (`supports_checkpoints`, the engine's `checkpoints_supported`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from corral.backends import (
    CHECKPOINTS_LIMITATION,
    CheckpointArtifact,
    PathChange,
    backend_limitations,
    supports_checkpoints,
)
from corral.backends.kubernetes._backend import LIMITATIONS as K8S_LIMITATIONS
from corral.backends.local import LocalBackend


def test_a_checkpoint_artifact_round_trips_and_refuses_what_is_not_one() -> None:
    artifact = CheckpointArtifact("ckpt-0123456789abcdef", 42, {"manifest": "m-1"})
    assert CheckpointArtifact.from_json(artifact.to_json()) == artifact
    with pytest.raises(ValueError, match="not a checkpoint artifact"):
        CheckpointArtifact.from_json({"checkpoint_id": "ckpt-x"})


def test_a_path_change_says_what_it_is() -> None:
    change = PathChange("/workspace/a.txt", "modified", 3, 5, "file")
    assert change.to_json() == {"path": "/workspace/a.txt", "kind": "modified", "size": 3, "old_size": 5,
                                "type": "file"}


def test_kubernetes_declares_it_cannot_and_the_local_backend_can(tmp_path: Path) -> None:
    assert "Kubernetes" in K8S_LIMITATIONS[CHECKPOINTS_LIMITATION]
    assert supports_checkpoints(LocalBackend(tmp_path))
    assert not supports_checkpoints(object())  # implements nothing of it


def test_a_declared_limitation_wins_over_an_implementation(tmp_path: Path) -> None:
    backend = LocalBackend(tmp_path)
    backend.limitations = {CHECKPOINTS_LIMITATION: "not on this host"}
    assert CHECKPOINTS_LIMITATION in backend_limitations(backend) and not supports_checkpoints(backend)
