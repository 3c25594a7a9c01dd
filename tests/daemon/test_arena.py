"""The shared-memory arena: create, attach from another process, views, tensors, lifecycle."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tierd.daemon.arena import OwnedArena
from tierd.wire.arena import ShmArena

MiB = 1 << 20
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def name() -> Iterator[str]:
    """A fresh arena name under /dev/shm, removed after the test whatever happens."""
    arena_name = f"tierd-test-{os.getpid()}-{secrets.token_hex(4)}"
    yield arena_name
    Path("/dev/shm", arena_name).unlink(missing_ok=True)


def test_create_view_tensor_round_trip(name: str) -> None:
    """Bytes written through a view are seen by the tensor and the file, and vice versa."""
    arena = OwnedArena.create(name, 4 * MiB)
    assert (arena.name, arena.path, arena.size) == (name, f"/dev/shm/{name}", 4 * MiB)
    assert os.stat(arena.path).st_size == 4 * MiB
    assert oct(os.stat(arena.path).st_mode & 0o777) == "0o600"
    arena.view(MiB, 4)[:] = b"abcd"
    tensor = arena.as_tensor()
    assert (tensor.dtype, tensor.shape) == (torch.uint8, (4 * MiB,))
    assert bytes(tensor[MiB : MiB + 4].tolist()) == b"abcd"
    tensor[2 * MiB : 2 * MiB + 3].copy_(torch.tensor([7, 8, 9], dtype=torch.uint8))
    assert bytes(arena.view(2 * MiB, 3)) == b"\x07\x08\x09"
    with open(arena.path, "rb") as f:
        f.seek(MiB)
        assert f.read(4) == b"abcd"
    del tensor
    arena.close()
    arena.unlink()
    assert not os.path.exists(arena.path)


def test_attach_from_another_process(name: str) -> None:
    """A real engine process attaches by name, reads the daemon's bytes, writes its own back,
    exits without any resource-tracker complaint, and the segment survives it."""
    arena = OwnedArena.create(name, 2 * MiB)
    arena.view(0, 5)[:] = b"hello"
    engine = textwrap.dedent(f"""
        import torch
        from tierd.wire.arena import ShmArena
        a = ShmArena.attach({name!r}, prefault=True)
        assert a.size == {2 * MiB}, a.size
        assert bytes(a.view(0, 5)) == b"hello"
        t = a.as_tensor()
        t[{MiB}:{MiB} + 4].copy_(torch.tensor(list(b"kv!!"), dtype=torch.uint8))
        del t
        a.close()
    """)
    done = subprocess.run([sys.executable, "-c", engine], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert (done.returncode, done.stderr) == (0, "")
    assert bytes(arena.view(MiB, 4)) == b"kv!!"
    assert bytes(arena.view(0, 5)) == b"hello"  # attach's prefault left the contents alone
    assert os.path.exists(arena.path)
    arena.close()
    arena.unlink()


def test_bad_input_and_lifecycle(name: str) -> None:
    """Bad sizes, names and ranges raise ValueError naming the fix; close is idempotent and
    leaves live views valid; unlink is idempotent."""
    with pytest.raises(ValueError, match="must be > 0"):
        OwnedArena.create(name, 0)
    with pytest.raises(ValueError, match="plain file name"):
        OwnedArena.create("a/b", MiB)
    with pytest.raises(FileNotFoundError):
        ShmArena.attach(name)
    arena = OwnedArena.create(name, MiB, prefault=False)
    with pytest.raises(ValueError, match="already exists"):
        OwnedArena.create(name, MiB)
    for offset, length in [(-1, 4), (MiB - 2, 4), (0, 0)]:
        with pytest.raises(ValueError, match="outside arena"):
            arena.view(offset, length)
    view = arena.view(MiB - 4, 4)
    view[:] = b"last"
    arena.close()
    arena.close()
    assert bytes(view) == b"last"  # still mapped until the view is freed
    with pytest.raises(ValueError, match="is closed"):
        arena.view(0, 4)
    arena.unlink()
    arena.unlink()
    assert not os.path.exists(arena.path)


def test_create_in_another_directory(tmp_path: Path) -> None:
    """An arena can live in any directory; pre-fault zero-fills and keeps the size exact."""
    arena = OwnedArena.create("arena", 3 * MiB + 4096, directory=str(tmp_path))
    assert arena.path == str(tmp_path / "arena")
    assert bytes(arena.view(3 * MiB, 4096)) == bytes(4096)
    other = ShmArena.attach("arena", directory=str(tmp_path))
    other.view(0, 2)[:] = b"ok"
    assert bytes(arena.view(0, 2)) == b"ok"
    other.close()
    arena.close()
    arena.unlink()


def test_tensor_outlives_close_and_unlink(name: str) -> None:
    """A tensor from as_tensor() stays valid after the arena is closed and unlinked (no dangling
    pointer: the tensor's storage owns its own mapping), and shares bytes with the arena."""
    arena = OwnedArena.create(name, 1 << 20, prefault=False)
    tensor = arena.as_tensor()
    tensor[10:14] = 9
    assert bytes(arena.view(10, 4)) == b"\x09" * 4
    arena.view(20, 2)[:] = b"\x05\x06"
    assert tensor[20:22].tolist() == [5, 6]
    arena.close()
    arena.unlink()
    tensor[0] = 3
    assert tensor[[0, 10, 20]].tolist() == [3, 9, 5]


def test_as_tensor_prefault_keeps_contents(name: str) -> None:
    """as_tensor() pre-faults its own mapping (the default) without changing a byte."""
    arena = OwnedArena.create(name, 1 << 20, prefault=False)
    arena.view(0, 4)[:] = b"kv!!"
    for prefault in (True, False):
        tensor = arena.as_tensor(prefault=prefault)
        assert bytes(tensor[:4].numpy()) == b"kv!!" and int(tensor[4:].sum()) == 0
    arena.close()
    arena.unlink()
