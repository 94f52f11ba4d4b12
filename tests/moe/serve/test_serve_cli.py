"""`expertcache serve`'s command line as a newcomer meets it: --help and the first mistakes.

    expertcache serve --help ─► a short description, an example, every flag with its help, no diagram
    --model DIR that does not exist ─► one line naming --model and the `hf download` that fetches it
    a model directory without tokenizer.json ─► the same command for the tokenizer files
    the start lines count in words ("1 layer"); EXPERTCACHE_CUDA_GRAPHS=1 on the CPU names the variable
"""

from __future__ import annotations

import os
import re
import socket

import pytest

from moe.cli import build_parser, main
from moe.serve.cli import build_state

DIAGRAM = "─►├┐└┘│◄"
FLAGS = ["--model", "--moe-slots", "--moe-cache-gb", "--moe-cache-policy", "--device", "--max-batch", "--max-seq-len",
         "--kv-cache-gb", "--host", "--port", "--api-key-file", "--log-level"]


def _help(capsys) -> str:
    with pytest.raises(SystemExit) as e:
        main(["serve", "--help"])
    assert e.value.code == 0
    return capsys.readouterr().out


def test_help_is_for_users_not_a_class_diagram(capsys):
    text = _help(capsys)
    assert not set(text) & set(DIAGRAM), [c for c in DIAGRAM if c in text]
    assert "TextTokenizer" not in text and "Scheduler" not in text and "moe.engine" not in text
    assert "OpenAI-compatible" in text and "Anthropic's Messages API" in text and "hf download" in text
    for flag in FLAGS:
        assert flag in text
    sub = next(a for a in build_parser()._actions if a.choices and "serve" in a.choices).choices["serve"]
    assert [a.option_strings for a in sub._actions if not a.help] == []  # every flag says what it does


def test_a_missing_model_directory_says_how_to_download_it(tmp_path):
    missing = tmp_path / "Qwen1.5-MoE-A2.7B"
    with pytest.raises(SystemExit) as e:
        build_state(build_parser().parse_args(["serve", "--model", str(missing), "--moe-slots", "8"]))
    message = str(e.value.code)
    assert message.startswith(f"error: --model {missing} is not a directory")
    assert f"hf download REPO --local-dir {missing}" in message and "huggingface-cli" not in message


def test_a_checkpoint_without_its_tokenizer_says_how_to_download_it(tiny_dir, tmp_path):
    from moe.serve.tokenizer import TextTokenizer, TokenizerError

    (tmp_path / "config.json").write_text((tiny_dir / "config.json").read_text())
    with pytest.raises(TokenizerError, match=f"hf download REPO tokenizer.json tokenizer_config.json --local-dir "
                                             f"{tmp_path}$"):
        TextTokenizer(tmp_path)


class _Stopped:
    def run(self, sockets=None) -> None:
        """The server returns at once (as after SIGTERM)."""


def test_the_start_lines_count_in_words(tiny_family, monkeypatch, capsys):
    """qwen3_next's tiny model has one full-attention layer: "1 layer", never "1 layers"."""
    monkeypatch.setattr("moe.serve.server.make_server", lambda *a, **k: _Stopped())
    assert main(["serve", "--model", str(tiny_family("qwen3_next")), "--moe-slots", "6", "--max-batch", "2",
                 "--device", "cpu", "--port", "0"]) == 0
    out = capsys.readouterr().out
    assert "bytes a token: 1 layer x k, v x 2 heads" in out and "a sequence: 2 layers)" in out
    assert not re.search(r"\b1 [a-zA-Z ]*s\b x", out) and "1 layers" not in out, out


def test_cuda_graphs_asked_for_on_the_cpu_name_the_variable(tiny_dir, monkeypatch):
    monkeypatch.setenv("EXPERTCACHE_CUDA_GRAPHS", "1")
    monkeypatch.setattr("moe.engine.loading.load_checkpoint", lambda *a, **k: pytest.fail("tensors were read"))
    with pytest.raises(SystemExit, match="error: EXPERTCACHE_CUDA_GRAPHS=1 asks for CUDA-graph decode, which needs "
                                         "a CUDA device, and the model is to load on cpu: unset"):
        build_state(build_parser().parse_args(["serve", "--model", str(tiny_dir), "--moe-slots", "16",
                                               "--device", "cpu"]))


def test_cpu_worker_env_makes_openmp_sleep_only_where_the_cpu_computes_misses(monkeypatch):
    from moe.serve.cli import cpu_worker_env

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    cpu_worker_env("copy")
    assert "OMP_WAIT_POLICY" not in os.environ
    cpu_worker_env("hybrid")
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    cpu_worker_env("cpu")
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE", "a user's own setting is kept"


def test_the_help_gives_the_prefix_block_size(capsys):
    from moe.engine.prefix import PREFIX_BLOCK_TOKENS

    assert f"blocks of {PREFIX_BLOCK_TOKENS} tokens" in " ".join(_help(capsys).split())


@pytest.mark.parametrize("family, gb, message", [
    ("qwen3_moe", "0", "--kv-cache-gb must be a number of GiB > 0"),
    ("qwen3_moe", "1e-9", "--kv-cache-gb 1e-09 holds no prefix block"),
    ("qwen3_next", "1e-9", "snapshots of the linear-attention state"),
    ("gpt_oss", "1", "sliding window of 4"),  # the tiny model's window is below a block
])
def test_a_prefix_cache_that_cannot_be_is_refused_by_its_flag(tiny_family, family, gb, message):
    argv = ["serve", "--model", str(tiny_family(family)), "--moe-slots", "6", "--max-batch", "2", "--device", "cpu",
            "--kv-cache-gb", gb]
    with pytest.raises(SystemExit) as e:
        build_state(build_parser().parse_args(argv))
    assert message in str(e.value.code) and "--kv-cache-gb" in str(e.value.code)


def test_the_start_lines_give_the_prefix_cache(tiny_family, monkeypatch, capsys):
    monkeypatch.setattr("moe.serve.server.make_server", lambda *a, **k: _Stopped())
    assert main(["serve", "--model", str(tiny_family("qwen3_moe")), "--moe-slots", "6", "--max-batch", "2",
                 "--device", "cpu", "--kv-cache-gb", "0.001", "--port", "0"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"\+ prefix cache [0-9.e-]+ GiB \([0-9,]+ blocks of 64 tokens: --kv-cache-gb\)", out), out


def test_the_help_gives_the_prefill_chunk_and_decode_share_defaults(capsys):
    from moe.engine.engine import PREFILL_CHUNK
    from moe.serve.scheduler import DECODE_SHARE

    text = " ".join(_help(capsys).split())
    assert f"(default {PREFILL_CHUNK})" in text and f"(default {DECODE_SHARE};" in text


@pytest.mark.parametrize("extra, message", [
    (["--prefill-chunk", "0"], "--prefill-chunk must be a whole number of tokens >= 1"),
    (["--prefill-chunk", "100", "--kv-cache-gb", "0.01"], "--prefill-chunk 100 must be a multiple of"),
    (["--tensor-parallel", "0"], "--tensor-parallel must be >= 1"),
    (["--decode-share", "1"], "--decode-share must be >= 0 and < 1, got 1.0"),
    (["--decode-share", "nan"], "--decode-share must be >= 0 and < 1, got nan"),
    (["--tensor-parallel", "2", "--moe-miss-service", "hybrid"], "drop --moe-miss-service hybrid"),
    (["--tensor-parallel", "999"], "--tensor-parallel 999 is above the model's"),
    (["--tensor-parallel", "2", "--moe-slots", "12"], "--moe-slots 12 is above"),  # 16 experts, 8 a rank
])
def test_a_bad_prefill_chunk_or_rank_count_is_refused_by_its_flag(tiny_family, extra, message):
    argv = ["serve", "--model", str(tiny_family("qwen3_moe")), "--moe-slots", "6", "--max-batch", "2",
            "--device", "cpu", *extra]
    with pytest.raises(SystemExit) as e:
        build_state(build_parser().parse_args(argv))
    assert message in str(e.value.code)


@pytest.mark.parametrize("port", ["-1", "65536"])
def test_a_port_out_of_range_names_the_flag(tiny_dir, port):
    with pytest.raises(SystemExit, match=f"error: --port must be 0 to 65535 \\(0: a free one\\), got {port}$"):
        main(["serve", "--model", str(tiny_dir), "--moe-slots", "16", "--device", "cpu", "--port", port])


def test_a_port_in_use_fails_before_the_model_loads(tiny_dir, monkeypatch, capsys):
    monkeypatch.setattr("moe.engine.loading.load_checkpoint", lambda *a, **k: pytest.fail("tensors were read"))
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(SystemExit) as e:
            main(["serve", "--model", str(tiny_dir), "--moe-slots", "16", "--device", "cpu", "--port", str(port)])
    message = str(e.value.code)
    assert message.startswith(f"error: --host 127.0.0.1 --port {port}: cannot listen there (Address already in use)")
    assert "pass another --port (0 takes a free one)" in message
    assert "expert cache:" not in capsys.readouterr().out


def test_port_0_serves_on_a_free_port_named_on_the_serving_line(tiny_dir, monkeypatch, capsys):
    from moe.testing.served import served_url

    bound = []

    class Listening:
        def run(self, sockets=None) -> None:
            bound.extend(s.getsockname() for s in sockets)

    monkeypatch.setattr("moe.serve.server.make_server", lambda state, host, port, level: Listening())
    assert main(["serve", "--model", str(tiny_dir), "--moe-slots", "16", "--device", "cpu", "--port", "0"]) == 0
    (host, port), = bound
    assert host == "127.0.0.1" and port > 0
    assert served_url(capsys.readouterr().out) == f"http://127.0.0.1:{port}"


def test_a_host_that_is_no_address_names_the_flag(tiny_dir):
    with pytest.raises(SystemExit, match="error: --host no-such-host.invalid: not an address of this machine"):
        main(["serve", "--model", str(tiny_dir), "--moe-slots", "16", "--device", "cpu", "--host",
              "no-such-host.invalid", "--port", "0"])
