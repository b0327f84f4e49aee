"""Regenerate, then capture, against a real server: ``transformers serve`` on the tiny target.

One server per module (about 6 s to start), bound to 127.0.0.1 on a free port, ready when /health
answers, killed in the fixture's finalizer. ``DSPARK_ENGINE_URL`` points the same tests at another
engine (scripts/vllm_lane.sh starts vLLM's CPU build and sets it, with ``DSPARK_ENGINE_TOKEN_IDS=1``).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from helpers import QWEN3_TOKENIZER, REPO

from dspark_precompute.contract.manifest import Manifest
from dspark_precompute.contract.store import CacheStore

TOKEN_IDS = os.environ.get("DSPARK_ENGINE_TOKEN_IDS") == "1"


def save_target(d: Path) -> Path:
    """The tiny random Qwen3 (untied head: a tied random one answers only newlines) with Qwen3's tokenizer."""
    from transformers import AutoTokenizer

    from dspark_precompute.write.config.schema import RandomTargetConfig
    from dspark_precompute.write.target import tiny

    tok = AutoTokenizer.from_pretrained(QWEN3_TOKENIZER) if QWEN3_TOKENIZER.is_dir() else tiny.build_tokenizer()
    rc = RandomTargetConfig(hidden_size=256, head_dim=64, intermediate_size=512, tie_word_embeddings=False)
    model = tiny.build_target(rc, len(tok))
    model.generation_config.eos_token_id = tok.eos_token_id
    model.save_pretrained(d, safe_serialization=True)
    tok.save_pretrained(d)
    return d


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PortTaken(Exception):
    """The port picked was bound by another process before the server bound it."""


def wait_ready(url: str, proc: subprocess.Popen, log: Path, limit: float = 300.0) -> None:
    """Poll /health until it answers 200 (a deadline, never a fixed sleep); the server's log if it dies.

    A server that exits because its port was taken in the meantime raises :class:`PortTaken` (the caller picks
    another); one that answers while ours has exited is another process's server, never taken for ours."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            text = log.read_text(errors="replace")
            if "address already in use" in text.lower():
                raise PortTaken(url)
            pytest.fail(f"the server exited ({proc.returncode}):\n{text[-3000:]}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200 and proc.poll() is None:
                    return
        except OSError:
            pass
        time.sleep(0.2)  # polling interval of the readiness probe
    pytest.fail(f"the server did not answer /health within {limit:.0f}s:\n{log.read_text()[-3000:]}")


def serve(target: Path, log: Path, tries: int = 5) -> tuple[subprocess.Popen, str]:
    """``transformers serve`` of ``target`` on a free port, its log in ``log``: (process, base url). A port that
    another process bound between our pick and the server's bind is picked again."""
    exe = Path(sys.executable).with_name("transformers")
    for _ in range(tries):
        port = free_port()
        with open(log, "wb") as fh:
            proc = subprocess.Popen([str(exe), "serve", str(target), "--host", "127.0.0.1", "--port", str(port),
                                     "--device", "cpu"], stdout=fh, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        try:
            wait_ready(f"http://127.0.0.1:{port}", proc, log)
            return proc, f"http://127.0.0.1:{port}"
        except PortTaken:
            proc.wait()
        except BaseException:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
    pytest.fail(f"{tries} ports in a row were taken before the server bound them")


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """(base_url, served target dir): DSPARK_ENGINE_URL's server, else a `transformers serve` of our own."""
    if os.environ.get("DSPARK_ENGINE_URL"):
        yield os.environ["DSPARK_ENGINE_URL"], Path(os.environ["DSPARK_ENGINE_MODEL"])
        return
    exe = Path(sys.executable).with_name("transformers")
    pytest.importorskip("fastapi", reason="transformers serve needs transformers[serving] (the test extra)")
    if not exe.is_file():
        pytest.skip(f"no transformers CLI beside {sys.executable}")
    target = save_target(tmp_path_factory.mktemp("served"))
    proc, url = serve(target, target / "serve.log")
    try:
        yield f"{url}/v1", target
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def command(engine, tmp_path: Path, cache: str, *extra: str) -> list[str]:
    url, target = engine
    return [sys.executable, "-m", "dspark_precompute", f"model.path={target}", "regenerate=server",
            f"regenerate.base_urls=[{url}]", "regenerate.max_tokens=8", "regenerate.concurrency=2",
            *(["regenerate.return_token_ids=true"] if TOKEN_IDS else []),
            "data.max_samples=4", f"storage.path={tmp_path / cache}", "seq_length=256", "batch.max_tokens=1024",
            "progress=false", f"hydra.run.dir={tmp_path / 'hydra'}", *extra]


def run(cmd: list[str], **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600, env={**os.environ, **env})


def ask_directly(engine, messages: list[dict]) -> str:
    """The oracle: a plain openai client call with the same settings."""
    import openai

    url, target = engine
    client = openai.OpenAI(base_url=url, api_key="EMPTY")
    r = client.chat.completions.create(model=str(target), messages=messages, max_tokens=8, temperature=0.0,
                                       extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    return r.choices[0].message.content or ""


def test_one_command_regenerates_with_the_target_then_captures_the_regenerated_rows(engine, tmp_path):
    done = run(command(engine, tmp_path, "cache"))
    assert done.returncode == 0, done.stderr[-3000:]
    out = tmp_path / "cache.regenerated.jsonl"
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(rows) == 4
    for row in rows:
        msgs = row["messages"]
        last = max(i for i, m in enumerate(msgs) if m["role"] == "assistant")
        assert msgs[last]["content"] == ask_directly(engine, [{"role": m["role"], "content": m["content"]}
                                                              for m in msgs[:last]])
    m = Manifest.read(CacheStore(str(tmp_path / "cache")))
    framed = hashlib.sha256(out.name.encode() + b"\0" + out.read_bytes()).hexdigest()
    assert m.identity["data"]["content_sha256"] == framed and m.counts.samples == 4
    regen = m.provenance.regeneration
    assert regen["served_model"] == str(engine[1]) and regen["same_model"] is True
    assert regen["output_sha256"] == hashlib.sha256(out.read_bytes()).hexdigest()
    assert regen["counts"]["rows_in"] == 4 == regen["counts"]["regenerated"] + regen["counts"]["rejected"]
    if TOKEN_IDS:
        assert regen["counts"]["token_checked_turns"] >= 4
    info = run([sys.executable, "-m", "dspark_precompute.cli.cache", "info", str(tmp_path / "cache")])
    assert "regenerated by" in info.stdout and "regenerated 4 of 4 row(s)" in info.stdout, info.stdout


@pytest.mark.slow  # moved out of the default lane to keep it under 10 minutes (CONTRIBUTING)
def test_a_regeneration_killed_mid_run_resumes_asking_only_the_missing_rows(engine, tmp_path):
    killed = run(command(engine, tmp_path, "cache", "regenerate.only=true"), DSPARK_FAULT="regenerate_row=2")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    out = tmp_path / "cache.regenerated.jsonl"
    assert not out.exists()
    log = out.with_name(out.name + ".parts") / "log.jsonl"
    assert len(log.read_text().splitlines()) == 2
    again = run(command(engine, tmp_path, "cache"))
    assert again.returncode == 0, again.stderr[-3000:]
    meta = json.loads((tmp_path / "cache.regenerated.meta.json").read_text())
    assert meta["counts"]["asked_now"] == 2 and meta["counts"]["regenerated"] == 4
    whole = tmp_path / "whole"
    shutil.rmtree(whole, ignore_errors=True)
    whole.mkdir()
    fresh = run(command(engine, whole, "cache", "regenerate.only=true"))
    assert fresh.returncode == 0, fresh.stderr[-2000:]
    assert out.read_bytes() == (whole / "cache.regenerated.jsonl").read_bytes()
