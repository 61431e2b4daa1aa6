"""CPU/GPU target detection and the compile-cache key."""

import torch

from agent.replica import compile_cache, targets


def test_cpu_target_lists_capability_and_extra_flags_in_fixed_order(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu amx_tile sse avx512_bf16 avx2\n\nprocessor\t: 1\n")
    got = targets.cpu_target(info)
    cap = torch.backends.cpu.get_cpu_capability().lower()
    assert got.endswith(f"-{cap}+avx512_bf16+amx_tile")
    assert targets.cpu_flags(info) == {"fpu", "amx_tile", "sse", "avx512_bf16", "avx2"}


def test_missing_cpuinfo_gives_the_plain_capability(tmp_path):
    assert targets.cpu_flags(tmp_path / "absent") == set()
    assert "+" not in targets.cpu_target(tmp_path / "absent")


def test_current_target_refuses_unknown_devices():
    assert targets.current_target("cpu") == targets.cpu_target()
    import pytest
    with pytest.raises(ValueError, match="mps"):
        targets.current_target("mps")
    if not torch.cuda.is_available():
        assert targets.gpu_target() is None
        with pytest.raises(ValueError, match="no such CUDA device"):
            targets.current_target("cuda")


def test_compile_cache_is_keyed_by_torch_version_and_target(tmp_path):
    env: dict[str, str] = {}
    chosen = compile_cache.apply_cache_env(tmp_path, environ=env)
    assert chosen == env and set(env) == set(compile_cache.CACHE_ENV)
    key = compile_cache.cache_key()
    assert torch.__version__ in key and key.startswith("torch-") and "/cpu/" in key
    for variable, sub in compile_cache.CACHE_ENV.items():
        assert env[variable] == str(tmp_path / key / sub)
        assert (tmp_path / key / sub).is_dir()
