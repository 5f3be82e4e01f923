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
import urllib.error
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
    # QSPEC_SERVER_TEST_DISABLE=all runs the same server with the plugin off (docs/results.md: its latencies).
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", QSPEC_VLLM_DISABLE=os.environ.get("QSPEC_SERVER_TEST_DISABLE", ""))
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


def spec_counters(url: str) -> tuple[float, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
        lines = response.read().decode().splitlines()
    total = lambda name: sum(float(line.split()[-1]) for line in lines if line.startswith(name))  # noqa: E731
    return total("vllm:spec_decode_num_drafts_total"), total("vllm:spec_decode_num_accepted_tokens_total")


def test_requests_that_leave_temperature_unset_accept_drafts(server):
    """An OpenAI request without `temperature` is sampled at 1.0 (the model's generation config sets
    none): with the plugin its drafts are accepted (stock vLLM-CPU accepts almost none)."""
    from concurrent.futures import ThreadPoolExecutor

    from qspec_ext.prompts import heldout_prompts

    client = openai.OpenAI(base_url=server["url"] + "/v1", api_key="unused")
    questions = [r["prompt"] for r in heldout_prompts()[1::7][:12]]
    drafts_before, accepted_before = spec_counters(server["url"])

    def ask(question):
        return client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": question}],
                                              max_tokens=48)

    with ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(ask, questions))
    assert all(a.choices[0].message.content for a in answers)
    drafts, accepted = spec_counters(server["url"])
    length = 1 + (accepted - accepted_before) / (drafts - drafts_before)
    assert length >= 1.3, length


def test_the_server_holds_under_mixed_load_and_bad_requests(server):
    """48 requests, 12 at a time: greedy and sampled, seeds, logprobs, penalties, stop strings, n = 2,
    max_tokens 1..96, streamed and not, prompts from one token to near max_model_len. Each completes
    with a valid finish_reason within its limits; a streamed greedy request joins to its
    non-streamed text. Then 12 bad requests each get a 4xx with a message, and the server still
    answers. The latencies go to the test's output (docs/results.md keeps them)."""
    import random
    from concurrent.futures import ThreadPoolExecutor

    client = openai.OpenAI(base_url=server["url"] + "/v1", api_key="unused", max_retries=0, timeout=300)
    rng = random.Random(0)
    long_text = " ".join(["the quick brown fox jumps over the lazy dog"] * 40)  # ~400 tokens of a 512 window
    prompts = ["Hi", "Why is the sky blue?", "Write a Python function that reverses a string.",
               "Summarize: " + long_text[:1200], "1 + 1 =", long_text[:1600]]
    requests = []
    for i in range(48):
        request = dict(model="smollm2", messages=[{"role": "user", "content": prompts[i % len(prompts)]}],
                       max_tokens=1 + (i * 7) % 96)
        if i % len(prompts) == 5:
            request["max_tokens"] = 32  # the long prompt: near max_model_len with its answer
        if i % 2:
            request.update(temperature=rng.choice([0.6, 1.0]), seed=i if i % 4 == 1 else None)
        else:
            request["temperature"] = 0.0
        if i % 5 == 0:
            request.update(logprobs=True, top_logprobs=2)
        if i % 6 == 1:
            request.update(presence_penalty=0.5, frequency_penalty=0.3)
        if i % 6 == 3:
            request["extra_body"] = {"repetition_penalty": 1.1}
        if i % 8 == 2:
            request["stop"] = ["."]
        if i % 12 == 7:
            request["n"] = 2
        requests.append(request)

    def send(request):
        start = time.monotonic()
        if request.get("stream"):
            text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**request)
                           if c.choices)
            return request, text, time.monotonic() - start
        return request, client.chat.completions.create(**request), time.monotonic() - start

    for i in range(0, 48, 4):
        requests[i]["stream"] = i % 8 == 0
    with ThreadPoolExecutor(12) as pool:
        results = list(pool.map(send, requests))
    latencies = sorted(seconds for _, _, seconds in results)
    for request, response, _ in results:
        if request.get("stream"):
            assert isinstance(response, str)
            continue
        assert len(response.choices) == request.get("n", 1)
        for choice in response.choices:
            assert choice.finish_reason in ("stop", "length"), choice.finish_reason
            assert response.usage.completion_tokens <= request["max_tokens"] * request.get("n", 1)
            if request.get("logprobs"):
                assert choice.logprobs is not None and choice.logprobs.content
    # A streamed greedy request joins to its non-streamed text.
    greedy = dict(model="smollm2", messages=[{"role": "user", "content": prompts[1]}], max_tokens=40, temperature=0.0)
    plain = client.chat.completions.create(**greedy).choices[0].message.content
    assert send({**greedy, "stream": True})[1] == plain

    bad = [dict(model="no-such-model"), dict(max_tokens=-1), dict(max_tokens=10**9), dict(temperature=-0.5),
           dict(top_p=1.5), dict(messages=[{"role": "user", "content": long_text * 4}]), dict(n=0),
           dict(presence_penalty=5.0), dict(frequency_penalty=-3.0), dict(top_k=-5), dict(logprobs=True, top_logprobs=99),
           dict(messages="not a list")]
    url = server["url"] + "/v1/chat/completions"
    for change in bad:
        body = {"model": "smollm2", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, **change}
        status, text = post(url, json.dumps(body).encode())
        assert 400 <= status < 500 and text, (change, status, text[:300])
    status, text = post(url, b'{"model": "smollm2", "messages": [')  # malformed JSON
    assert 400 <= status < 500, (status, text[:300])
    assert client.chat.completions.create(**greedy).choices[0].message.content == plain, "answers after bad requests"
    log = server["log"].read_text()
    assert "Traceback" not in log, log[-4000:]
    print(f"\nmixed load: {len(results)} requests, 12 at a time, 0 failed; latency p50 "
          f"{latencies[len(latencies) // 2]:.1f} s, p95 {latencies[int(len(latencies) * 0.95)]:.1f} s")


def post(url: str, body: bytes) -> tuple[int, str]:
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()
