"""Building and loading polo's native CPU kernels (`polo.kernels.cpu.native`), and doing without them."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from polo.kernels.cpu import native


def test_polo_native_0_turns_them_off_without_a_word(monkeypatch, capsys):
    monkeypatch.setenv("POLO_NATIVE", "0")
    assert native.native_ops.__wrapped__() is None
    assert capsys.readouterr().err == ""


def test_a_polo_native_value_other_than_0_or_1_is_named_in_one_line_and_leaves_them_on(monkeypatch, capsys):
    monkeypatch.setenv("POLO_NATIVE", "off")
    assert native.wanted() is True
    assert capsys.readouterr().err == "polo: POLO_NATIVE='off' is neither 0 nor 1; native CPU kernels stay on\n"
    monkeypatch.setenv("POLO_NATIVE", "0")
    assert native.wanted() is False


def test_a_failed_build_gives_one_line_naming_the_compilers_complaint(monkeypatch, tmp_path, capsys):
    from torch.utils import cpp_extension

    monkeypatch.delenv("POLO_NATIVE", raising=False)
    monkeypatch.setenv("POLO_CACHE", str(tmp_path))
    monkeypatch.setattr(native, "capability", lambda: "AVX2")

    def failing_build(**_):
        raise RuntimeError(
            "Error building extension 'polo_native': [1/2] c++ ... -c norms.cpp\n"
            "norms.cpp:12:3: error: 'fVec' was not declared in this scope\n"
            "ninja: build stopped: subcommand failed."
        )

    monkeypatch.setattr(cpp_extension, "load", failing_build)
    assert native.native_ops.__wrapped__() is None
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1] == (
        "polo: native CPU kernels unavailable (norms.cpp:12:3: error: 'fVec' was not declared in this scope); "
        "using torch's ops"
    )


def test_a_cpu_without_avx2_gets_no_native_kernels(monkeypatch, capsys):
    monkeypatch.delenv("POLO_NATIVE", raising=False)
    monkeypatch.setattr(native, "capability", lambda: "DEFAULT")
    assert native.native_ops.__wrapped__() is None
    assert "without AVX2" in capsys.readouterr().err


def test_the_build_is_kept_per_sources_torch_and_vector_width(monkeypatch, tmp_path):
    monkeypatch.setenv("POLO_CACHE", str(tmp_path))
    first = native.build_directory()
    assert first.parent == tmp_path / "native"
    monkeypatch.setattr(
        native, "capability", lambda: "AVX2" if torch.backends.cpu.get_cpu_capability() != "AVX2" else "AVX512"
    )
    assert native.build_directory() != first
    monkeypatch.undo()
    monkeypatch.setenv("POLO_CACHE", str(tmp_path))
    monkeypatch.setattr(torch, "__version__", "0.0.0")
    assert native.build_directory() != first


@pytest.mark.parametrize("name", ["decode_attention", "masked_softmax", "rms_norm", "rms_norm_backward", "silu_mul"])
def test_the_built_library_registers_every_kernel(native_kernels, name):
    assert hasattr(native_kernels, name)


def test_without_a_ninja_on_path_the_wheels_goes_on_it(monkeypatch, tmp_path):
    import ninja

    monkeypatch.setenv("PATH", str(tmp_path))  # a PATH with no ninja on it
    native.use_ninja_wheel()
    assert os.environ["PATH"].split(os.pathsep) == [ninja.BIN_DIR, str(tmp_path)]
    assert shutil.which("ninja") is not None
    native.use_ninja_wheel()  # found now: PATH is left alone
    assert os.environ["PATH"].split(os.pathsep) == [ninja.BIN_DIR, str(tmp_path)]


def test_a_killed_builds_leftover_lock_does_not_block_the_next_build(monkeypatch, tmp_path):
    """torch's build lock outlives a build killed mid-way; under polo's flock it is known stale and cleared."""
    from torch.utils import cpp_extension

    monkeypatch.delenv("POLO_NATIVE", raising=False)
    monkeypatch.setenv("POLO_CACHE", str(tmp_path))
    monkeypatch.setattr(native, "capability", lambda: "AVX2")
    directory = native.build_directory()
    directory.mkdir(parents=True)
    (directory / "lock").write_text("")  # what a SIGKILLed build leaves
    seen = []

    def build(**kwargs):  # torch would wait on the lock file forever; record whether it was still there
        seen.append((directory / "lock").exists())

    monkeypatch.setattr(cpp_extension, "load", build)
    native.native_ops.__wrapped__()
    assert seen == [False]
