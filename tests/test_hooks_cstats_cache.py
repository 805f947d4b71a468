"""Where the statistics kernel is cached and what it agrees to load (hooks/cstats.py).

The compiler is run once per session; the tests swap ``cstats._build`` for a copy of that build, so
they check the cache logic (folders, modes, owners, rebuilds), not the C code.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from hooks import cstats


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


@pytest.fixture(scope="session")
def built_so(tmp_path_factory: pytest.TempPathFactory) -> Path:
    compiler = _compiler()
    if not compiler:
        pytest.skip("no C compiler on PATH")
    out = tmp_path_factory.mktemp("cstats-build") / "ref.so"
    try:
        cstats._build(compiler, out)
    except RuntimeError as e:
        pytest.skip(f"the kernel does not build here: {e}")
    return out


class Env:
    """The patched world of one test: build counter, loaded paths, the primary and the temp dirs."""

    def __init__(self, tmp: Path) -> None:
        self.builds: list[Path] = []
        self.loaded: list[Path] = []
        self.primary = tmp / "home" / "cache" / "opband"
        self.tmpdir = tmp / "tmp"
        self.tmpdir.mkdir()
        self.fallback = self.tmpdir / f"opband-{os.getuid()}"

    @property
    def name(self) -> str:
        return cstats._lib_name(_compiler() or "")


@pytest.fixture
def env(tmp_path: Path, built_so: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Env]:
    e = Env(tmp_path)
    real_cdll = ctypes.CDLL

    def fake_build(compiler: str, out: Path) -> None:
        e.builds.append(out)
        shutil.copyfile(built_so, out)
        os.chmod(out, 0o775)  # what a umask of 002 gives: the installer must tighten it

    def cdll(path: str, *args: object, **kwargs: object) -> ctypes.CDLL:
        e.loaded.append(Path(path))
        return real_cdll(path, *args, **kwargs)

    monkeypatch.setattr(cstats, "_build", fake_build)
    monkeypatch.setattr(cstats.ctypes, "CDLL", cdll)
    monkeypatch.setenv("OPBAND_CACHE_DIR", str(e.primary))
    monkeypatch.delenv("OPBAND_CSTATS", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(e.tmpdir))
    cstats.reset()
    yield e
    cstats.reset()  # the next test loads the real cache again


def _load_ok() -> None:
    assert cstats.load() is not None, cstats.unavailable_reason()
    x = torch.arange(5.0)
    assert cstats.fused(x, torch.tensor([0, 4]))[:3] == [0.0, 4.0, 10.0]


def _mode(p: Path) -> int:
    return stat.S_IMODE(os.lstat(p).st_mode)


def env_built(env: Env) -> Path:
    """A real library outside the cache, to plant in it (made by the fake build; not counted)."""
    src = env.tmpdir / "planted.so"
    cstats._build("cc", src)
    env.builds.clear()
    return src


def test_primary_cache_is_created_private_and_reused(env: Env) -> None:
    _load_ok()
    so = env.primary / env.name
    assert env.loaded == [so] and len(env.builds) == 1
    assert _mode(env.primary) == 0o700
    assert _mode(so) & 0o077 == 0 and os.lstat(so).st_uid == os.getuid()
    assert not env.fallback.exists()  # the temp dir is only for an unwritable primary cache
    cstats.reset()
    _load_ok()
    assert len(env.builds) == 1 and env.loaded[-1] == so  # a cache hit


def test_temp_dir_only_when_the_primary_cache_is_not_writable(env: Env) -> None:
    blocker = env.primary.parent.parent
    blocker.parent.mkdir(parents=True, exist_ok=True)
    blocker.write_text("a file where the cache's parent should be")  # mkdir fails, even as root
    _load_ok()
    assert env.loaded == [env.fallback / env.name]
    assert _mode(env.fallback) == 0o700


def test_home_unset_goes_to_the_temp_dir(env: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_home(cls: type) -> Path:
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.delenv("OPBAND_CACHE_DIR")
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.delenv("HOME", raising=False)
    monkeypatch.setattr(cstats.Path, "home", classmethod(no_home))
    _load_ok()
    assert env.loaded == [env.fallback / env.name]


def test_library_in_a_shared_folder_is_never_loaded(env: Env) -> None:
    """A group/world-writable cache folder: another user could have planted the file."""
    env.primary.mkdir(parents=True)
    planted = env.primary / env.name
    shutil.copyfile(env_built(env), planted)
    os.chmod(env.primary, 0o777)
    _load_ok()
    assert planted not in env.loaded
    assert env.loaded == [env.fallback / env.name]


def test_group_writable_library_is_replaced_not_loaded(env: Env) -> None:
    env.primary.mkdir(parents=True, mode=0o700)
    so = env.primary / env.name
    shutil.copyfile(env_built(env), so)
    os.chmod(so, 0o666)
    _load_ok()
    assert env.loaded == [so] and len(env.builds) == 1  # loaded only after the rebuild
    assert _mode(so) & 0o077 == 0


def test_symlinked_library_is_replaced_not_loaded(env: Env) -> None:
    env.primary.mkdir(parents=True, mode=0o700)
    so = env.primary / env.name
    so.symlink_to(env_built(env))
    _load_ok()
    assert len(env.builds) == 1 and not so.is_symlink()


def test_library_owned_by_someone_else_is_replaced(env: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    env.primary.mkdir(parents=True, mode=0o700)
    so = env.primary / env.name
    shutil.copyfile(env_built(env), so)
    os.chmod(so, 0o600)
    real_lstat = os.lstat
    planted_ino = real_lstat(so).st_ino

    def lstat(path: object, *args: object, **kwargs: object) -> os.stat_result:
        st = real_lstat(path, *args, **kwargs)  # type: ignore[arg-type]
        if st.st_ino != planted_ino:
            return st
        fields = list(st)
        fields[4] = os.getuid() + 1  # st_uid: another user's file
        return os.stat_result(fields)

    monkeypatch.setattr(os, "lstat", lstat)
    _load_ok()
    assert len(env.builds) == 1 and env.loaded == [so]
    assert real_lstat(so).st_ino != planted_ino


def test_no_private_cache_builds_into_a_fresh_private_dir(env: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every cache folder foreign-owned (here: this process pretends to be another user)."""
    monkeypatch.setattr(cstats, "_uid", lambda: os.getuid() + 1)
    _load_ok()
    assert len(env.loaded) == 1 and len(env.builds) == 1
    where = env.loaded[0].parent
    assert where not in (env.primary, env.fallback) and where.name.startswith("opband-cstats-")
    assert not where.exists()  # removed once loaded
    assert not (env.primary / env.name).exists() and not (env.fallback / env.name).exists()


def test_corrupt_cached_library_is_rebuilt_once(env: Env) -> None:
    env.primary.mkdir(parents=True, mode=0o700)
    so = env.primary / env.name
    so.write_bytes(b"\x7fELF truncated")
    os.chmod(so, 0o600)
    _load_ok()
    assert env.loaded == [so, so] and len(env.builds) == 1
    assert so.read_bytes()[:4] == b"\x7fELF" and so.stat().st_size > 100


def test_library_that_still_fails_after_the_rebuild_falls_back_to_torch(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(path: str, *args: object, **kwargs: object) -> ctypes.CDLL:
        env.loaded.append(Path(path))
        raise OSError(f"{path}: invalid ELF header")

    monkeypatch.setattr(cstats.ctypes, "CDLL", broken)
    assert cstats.load() is None
    assert "does not load" in (cstats.unavailable_reason() or "")
    assert len(env.builds) == 1 and len(env.loaded) == 1  # built once, tried once, no loop
    from hooks.tensors import _row_dict, host_stats

    assert _row_dict(host_stats(torch.arange(4.0)))["mean"] == 1.5  # the torch path


def test_compile_failure_falls_back_to_torch(env: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(compiler: str, out: Path) -> None:
        raise RuntimeError("compiling the statistics kernel failed: boom")

    monkeypatch.setattr(cstats, "_build", fail)
    assert cstats.load() is None
    assert "boom" in (cstats.unavailable_reason() or "")
