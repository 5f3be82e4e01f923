"""Serving: vLLM's OpenAI server with the real pair (SmolLM2 and its shipped chain drafter, fp32) and
the qspec_ext plugin answers an OpenAI client's chat requests, plain and streamed, with the text
qspec_ext's own greedy decode gives; the plugin's seams ran in the server (its log says so), and
/metrics counts the drafts. Run in the vLLM venv."""

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

pytest.importorskip("vllm.entrypoints.openai.api_server")
openai = pytest.importorskip("openai")

MESSAGES = [{"role": "user", "content": "Why is the sky blue?"}]
NEW_TOKENS = 32
K = 3


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_up(server: subprocess.Popen, url: str, log, seconds: float = 600) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if server.poll() is not None:
            pytest.fail(f"the server exited with {server.returncode}:\n{log.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(2)
    pytest.fail(f"the server did not answer {url} within {seconds} s:\n{log.read_text()[-4000:]}")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from qspec_ext.shipped import drafter_dir, target_dir

    target, draft = target_dir("smollm2"), drafter_dir("smollm2")
    port = free_port()
    log = tmp_path_factory.mktemp("server") / "server.log"
    speculative = {"method": "eagle3", "model": str(draft), "num_speculative_tokens": K}
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(target),
               "--served-model-name", "smollm2", "--dtype", "float32", "--enforce-eager", "--max-model-len", "512",
               "--host", "127.0.0.1", "--port", str(port), "--seed", "0",
               "--speculative-config", json.dumps(speculative)]
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", QSPEC_VLLM_DISABLE="")
    with open(log, "w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        wait_until_up(process, f"http://127.0.0.1:{port}/health", log)
        yield {"url": f"http://127.0.0.1:{port}", "log": log, "target": target, "draft": draft}
    finally:
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def qspec_ext_text(target, draft) -> str:
    from qspec_ext import SpeculativeDecoder, load_pair
    from qspec_ext.text import chat_ids, load_tokenizer, stop_ids

    pair = load_pair(target, draft, dtype="fp32")
    result = SpeculativeDecoder(*pair, K).generate([chat_ids(target, MESSAGES)], NEW_TOKENS,
                                                   eos_token_id=stop_ids(target))
    return load_tokenizer(target).decode(result.tokens[0], skip_special_tokens=True)


def test_the_server_answers_an_openai_client_as_qspec_ext_decodes(server):
    client = openai.OpenAI(base_url=server["url"] + "/v1", api_key="unused")
    request = dict(model="smollm2", messages=MESSAGES, temperature=0.0, max_tokens=NEW_TOKENS)
    answer = client.chat.completions.create(**request).choices[0].message.content
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in
                       client.chat.completions.create(**request, stream=True) if chunk.choices)
    assert answer and streamed == answer
    assert answer == qspec_ext_text(server["target"], server["draft"])

    with urllib.request.urlopen(server["url"] + "/metrics", timeout=10) as response:
        metrics = response.read().decode()
    drafts = sum(float(line.split()[-1]) for line in metrics.splitlines()
                 if line.startswith("vllm:spec_decode_num_drafts_total"))
    accepted = sum(float(line.split()[-1]) for line in metrics.splitlines()
                   if line.startswith("vllm:spec_decode_num_accepted_tokens_total"))
    assert drafts > 0 and accepted > 0, [line for line in metrics.splitlines() if "spec_decode" in line]

    log = server["log"].read_text()
    assert "qspec_ext: seams on: rms_norm, rope, qk_norm_rope, aux_gather, rejection_sampler" in log, log[-4000:]
    ran = set(re.findall(r"qspec_ext: seam (\w+) ran", log))
    assert {"rms_norm", "rope", "aux_gather", "rejection_sampler"} <= ran, ran  # qk_norm_rope: Qwen3 targets
