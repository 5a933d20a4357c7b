"""Building the C attention kernel: the first use says it compiles, a failed build says which compiler failed."""

import logging

import pytest

from cbrun.kernels import c_build, cpu_attention


def test_failed_compile_names_the_compiler_and_its_exit_code(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("CC", "/bin/false")
    monkeypatch.setenv(c_build.CACHE_ENV, str(tmp_path))
    with caplog.at_level(logging.INFO, logger="cbrun.engine"):
        with pytest.raises(RuntimeError) as failure:
            cpu_attention.load_library(cpu_attention.SOURCE)
    assert "compiling the CPU attention kernel (first use, about 20 to 35 s)" in caplog.text
    assert str(failure.value) == ("compiling cpu_paged_attention.c with /bin/false failed (exit code 1): no output")


def test_missing_compiler_is_named(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", "no-such-cc-for-cbrun")
    monkeypatch.setenv(c_build.CACHE_ENV, str(tmp_path))
    with pytest.raises(RuntimeError, match="no C compiler \\('no-such-cc-for-cbrun' not found\\)"):
        cpu_attention.load_library(cpu_attention.SOURCE)
