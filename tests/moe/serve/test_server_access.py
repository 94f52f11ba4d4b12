"""`expertcache serve`'s access rules, connection timeouts and flags, over real sockets (CPU backend).

    API key sources (--api-key-file, --api-key, EXPERTCACHE_API_KEY), the Bearer scheme, /metrics
    behind the key unless --metrics-public, JSON-only POST bodies, --read-timeout for stalled and
    half-open clients, --keep-alive-timeout, and serve flags checked against the checkpoint and machine;
    --moe-cache-gb refused by name before the model loads, and the start line that prices the slots
"""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from moe.cli import build_parser, main
from moe.serve.cli import API_KEY_ENV, build_state
from tests.moe.serve.http_util import AUTH, KEY, NAME, serve
from tests.moe.serve.test_server_hardening import _error, _post


@pytest.fixture(scope="module")
def srv(tiny_dir):
    running = serve(tiny_dir, "--read-timeout", "0.6", "--keep-alive-timeout", "0.6")
    yield running
    running.stop()


def test_bearer_scheme_is_case_insensitive_and_metrics_need_the_key(srv):
    body = {"model": NAME, "prompt": "w9", "max_tokens": 1}
    for scheme in ("bearer", "BEARER", "Bearer"):
        r = httpx.post(srv.url + "/v1/completions", json=body, headers={"Authorization": f"{scheme} {KEY}"})
        assert r.status_code == 200
    for header in ({}, {"Authorization": KEY}, {"Authorization": "Basic " + KEY}, {"Authorization": "Bearer x"}):
        _error(httpx.post(srv.url + "/v1/completions", json=body, headers=header), 401, code="invalid_api_key")
    _error(httpx.get(srv.url + "/metrics"), 401, code="invalid_api_key")
    assert httpx.get(srv.url + "/metrics", headers=AUTH).status_code == 200
    assert httpx.get(srv.url + "/health").status_code == 200


def test_a_post_that_is_not_json_starts_no_generation(srv):
    submitted = srv.scheduler._submitted
    body = json.dumps({"model": NAME, "prompt": "w9", "max_tokens": 1})
    for kind in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None):
        headers = {**AUTH, **({"Content-Type": kind} if kind else {})}
        r = httpx.post(srv.url + "/v1/completions", content=body, headers=headers)
        _error(r, 415, param="Content-Type", code="unsupported_media_type")
    assert srv.scheduler._submitted == submitted
    assert _post(srv, "/v1/completions", body, headers={"Content-Type": "application/json; charset=utf-8"}
                 ).status_code == 200


def _closed_within(sock: socket.socket, seconds: float) -> float:
    """Seconds until the server closes `sock` (recv returns b""); fails after `seconds`."""
    sock.settimeout(seconds)
    start = time.monotonic()
    while sock.recv(65536):
        pass
    return time.monotonic() - start


@pytest.mark.parametrize("sent", [b"", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n",
                                  b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                  b"Authorization: Bearer sk-test-key\r\nContent-Length: 100\r\n\r\n{\"model\""])
def test_a_stalled_or_half_open_client_is_disconnected(srv, sent):
    with socket.create_connection(("127.0.0.1", srv.port)) as sock:
        sock.sendall(sent)
        assert _closed_within(sock, 3.0) < 2.0  # --read-timeout 0.6
    assert httpx.get(srv.url + "/health").json()["status"] == "ok"


def test_an_idle_keep_alive_connection_is_closed(srv):
    with socket.create_connection(("127.0.0.1", srv.port)) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        sock.settimeout(3)
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")
        assert _closed_within(sock, 3.0) < 2.0  # --keep-alive-timeout 0.6


def test_api_key_sources(tiny_dir, tmp_path, monkeypatch):
    base = ["serve", "--model", str(tiny_dir), "--moe-slots", "6", "--max-batch", "3", "--device", "cpu"]
    key_file = tmp_path / "key"
    key_file.write_text("sk-from-file\n")
    monkeypatch.setenv(API_KEY_ENV, "sk-from-env")
    state = build_state(build_parser().parse_args(base + ["--api-key-file", str(key_file)]))
    assert state.options.guard.api_key == "sk-from-file"
    assert build_state(build_parser().parse_args(base)).options.guard.api_key == "sk-from-env"
    monkeypatch.delenv(API_KEY_ENV)
    assert build_state(build_parser().parse_args(base)).options.guard.api_key is None
    key_file.write_text("  \n")
    with pytest.raises(SystemExit, match="--api-key-file"):
        build_state(build_parser().parse_args(base + ["--api-key-file", str(key_file)]))
    with pytest.raises(SystemExit, match="--api-key-file"):
        build_state(build_parser().parse_args(base + ["--api-key-file", str(tmp_path / "missing")]))
    with pytest.raises(SystemExit):
        build_parser().parse_args(base + ["--api-key-file", str(key_file), "--api-key", "k"])


def test_metrics_public_opens_metrics_only(tiny_dir):
    run = serve(tiny_dir, "--metrics-public")
    try:
        assert httpx.get(run.url + "/metrics").status_code == 200
        _error(httpx.get(run.url + "/v1/models"), 401)
    finally:
        run.stop()


# 10. serve flags against the checkpoint and the machine

@pytest.mark.parametrize("flags, message", [
    (["--device", "bogus"], "--device 'bogus'"),
    (["--device", "cpu:1"], "--device 'cpu:1'"),
    (["--max-seq-len", "257"], "--max-seq-len 257 is above the model's max_position_embeddings"),
    (["--moe-slots", "17"], "--moe-slots 17 is above the model's 16 routed experts"),
    (["--max-body-mb", "0"], "--max-body-mb"),
    (["--read-timeout", "-1"], "--read-timeout"),
])
def test_serve_flags_are_checked(tiny_dir, flags, message):
    args = build_parser().parse_args(
        ["serve", "--model", str(tiny_dir), "--moe-slots", "6", "--max-batch", "3", "--device", "cpu", *flags]
    )
    with pytest.raises(SystemExit, match=message.replace("(", r"\(").replace("'", "'?")):
        build_state(args)


@pytest.mark.cpu_only
@pytest.mark.parametrize("device", ["cuda", "cuda:0", "cuda:3"])
def test_cuda_without_a_gpu_is_refused(tiny_dir, device):
    args = build_parser().parse_args(
        ["serve", "--model", str(tiny_dir), "--moe-slots", "6", "--max-batch", "3", "--device", device]
    )
    with pytest.raises(SystemExit, match=f"--device {device}: no CUDA GPU is available"):
        build_state(args)


def test_the_default_context_is_capped_by_the_model(tiny_dir):
    args = build_parser().parse_args(
        ["serve", "--model", str(tiny_dir), "--moe-slots", "6", "--max-batch", "3", "--device", "cpu"]
    )
    assert build_state(args).options.max_seq_len == 256  # max_position_embeddings < 2048




@pytest.mark.parametrize("garbage", [b"GARBAGE\r\n\r\n", b"GET / HTTP/1.1\r\nHost x\r\n\r\n",
                                     b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03"])
def test_bytes_that_are_not_http_get_a_json_400(srv, garbage):
    with socket.create_connection(("127.0.0.1", srv.port)) as sock:
        sock.sendall(garbage)
        sock.settimeout(5)
        raw = b""
        while chunk := sock.recv(65536):
            raw += chunk
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400") and b"content-type: application/json" in head.lower()
    assert json.loads(body)["error"]["code"] == "invalid_http"
    assert httpx.get(srv.url + "/health").json()["status"] == "ok"


# 11. --moe-cache-gb G: one of it and --moe-slots, checked before the model loads, priced in the start line

# the tiny model: float32, 2 MoE layers x 8, top-2
SERVE = ["serve", "--max-batch", "3", "--device", "cpu", "--port", "0"]


def _no_load(*args, **kwargs):
    pytest.fail("the model was loaded")


@pytest.mark.parametrize("flags, message", [
    (["--moe-cache-gb", "0"], "error: --moe-cache-gb must be a number of GiB > 0, got 0.0"),
    (["--moe-cache-gb", "-2"], "error: --moe-cache-gb must be a number of GiB > 0, got -2.0"),
    (["--moe-cache-gb", "nan"], "error: --moe-cache-gb must be a number of GiB > 0, got nan"),
    (["--moe-cache-gb", "inf"], "error: --moe-cache-gb must be a number of GiB > 0, got inf"),
    (["--moe-cache-gb", "1e-9"], "error: --moe-cache-gb 1e-09 holds no float32 expert of 24,576 bytes"),
    (["--moe-cache-gb", "1e-9", "--dtype", "bfloat16"], "error: --moe-cache-gb 1e-09 holds no bf16 expert of 12,288"),
    (["--moe-cache-gb", "0.0001"], "error: --moe-cache-gb 0.0001 holds 4 float32 experts of 24,576 bytes, below "
                                   "--max-batch 3 x top_k 2 = 6: "),
    (["--moe-cache-gb", "0.00003"], "error: --moe-cache-gb 3e-05 holds 1 float32 expert of 24,576 bytes, below "
                                    "--max-batch 3 x top_k 2 = 6: "),
    (["--moe-slots", "0"], "error: --moe-slots must be >= 1, got 0"),  # the exit of the other flag errors
    (["--moe-slots", "5"], "error: --moe-slots 5 is below --max-batch 3 x top_k 2 = 6: one decode step could route "
                           "to more distinct experts than slots; raise --moe-slots to 6 or more, or lower --max-batch"),
    (["--moe-slots", "17"], "error: --moe-slots 17 is above the model's 16 routed experts (2 MoE layers x 8)"),
    (["--moe-slots", "16", "--max-batch", "9"], "error: --max-batch 9 x top_k 2 = 18 is above the model's 16 routed "
                                                "experts, the most slots a cache can have (it needs --max-batch x "
                                                "top_k); lower --max-batch to 8 or less"),
])
def test_moe_cache_gb_is_refused_by_name_before_the_model_loads(tiny_dir, monkeypatch, flags, message):
    monkeypatch.setattr("moe.engine.loading.load_model", _no_load)
    args = build_parser().parse_args([*SERVE, "--model", str(tiny_dir), *flags])
    with pytest.raises(SystemExit) as e:
        build_state(args)
    assert isinstance(e.value.code, str) and e.value.code.startswith(message)  # a message: exit status 1


@pytest.mark.parametrize("flags, message", [
    (["--moe-slots", "6", "--moe-cache-gb", "1"], "argument --moe-cache-gb: not allowed with argument --moe-slots"),
    ([], "one of the arguments --moe-slots --moe-cache-gb is required"),
    (["--moe-cache-gb", "lots"], "argument --moe-cache-gb: invalid float value: 'lots'"),
])
def test_both_or_neither_size_flag_is_a_usage_error(tiny_dir, monkeypatch, capsys, flags, message):
    monkeypatch.setattr("moe.engine.loading.load_model", _no_load)
    with pytest.raises(SystemExit) as e:
        main([*SERVE, "--model", str(tiny_dir), *flags])
    assert e.value.code == 2 and message in capsys.readouterr().err  # argparse's, as --api-key with --api-key-file


class _Stopped:
    def run(self, sockets=None) -> None:
        """The server returns at once (as after SIGTERM)."""


@pytest.mark.parametrize(
    "flags, line",
    [
        (
            ["--moe-cache-gb", "0.0002"],
            "expert cache: 8 slots x 24,576 bytes per float32 expert = 0.0001831 GiB of "
            "slot memory, for 16 experts (2 MoE layers x 8); budget --moe-cache-gb 0.0002 holds 8",
        ),
        (
            ["--moe-cache-gb", "0.0002", "--dtype", "bfloat16"],
            "expert cache: 16 slots x 12,288 bytes per bf16 expert = 0.0001831 GiB of slot memory, for 16 experts "
            "(2 MoE layers x 8); budget --moe-cache-gb 0.0002 holds 17, more than every expert: capped at 16 slots, "
            "every expert resident",
        ),
        (
            ["--moe-slots", "6"],
            "expert cache: 6 slots x 24,576 bytes per float32 expert = 0.0001373 GiB of slot memory, "
            "for 16 experts (2 MoE layers x 8)",
        ),
    ],
)
def test_the_start_line_gives_slots_bytes_gib_experts_and_budget(tiny_dir, monkeypatch, capsys, flags, line):
    monkeypatch.setattr("moe.serve.server.make_server", lambda *a, **k: _Stopped())
    assert main([*SERVE, "--model", str(tiny_dir), *flags]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == line
    slots = line.split()[2]
    assert out[1].startswith("device memory for the cache and the context: expert slots ")
    assert " + KV cache " in out[1] and " x --max-seq-len " in out[1] and "(--max-batch " in out[1]
    assert f" with {slots} slots, policy lru" in out[2]
