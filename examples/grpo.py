"""GRPO (Group Relative Policy Optimization, DeepSeekMath, arXiv 2402.03300) on the bundled SmolLM2-135M,
with a running Idleless server as the rollout engine and the new weights pushed back into it every step.

    python examples/grpo.py --steps 30 --out benchmarks/results/grpo       # SmolLM2-135M-Instruct, CPU
    python examples/grpo.py --model /path/to/hf-dir --steps 2              # any Llama-family HF directory

Each step:
  1. rollouts: ``--prompts`` arithmetic questions ("What is 7 + 5?"), ``--group-size`` samples each
     (one /generate request with n = group size, so the samples share the prompt's KV through the radix
     cache), temperature 1, with the engine's logprob of every sampled token;
  2. reward (verifiable): 1 when the first integer of the answer is the sum, plus 0.5 when the answer
     starts with a number (the asked format); advantages are the rewards normalised within each group
     (GRPO's outcome supervision);
  3. one policy-gradient step on the clipped objective with a k3 KL penalty to the initial policy
     (our model in training mode, ``idleless.rl.policy.KernelPolicy``, AdamW);
  4. the new weights are pushed into the server by a torch.distributed broadcast (gloo) from this
     process (``idleless.rl.trainer.WeightPusher``), version ``step-N``.

The trainer's forward is the engine's (``KernelPolicy``: every op an autograd function whose forward is
the engine's deterministic kernel and whose backward is written out), so the logprobs the loss uses are
the rollout's bit for bit and the gradient is that of exactly this computation; the server runs with
``--enable-deterministic-inference`` in float32 on the float weights.

Logged every step (JSONL, then a PNG of the curves): mean reward, KL to the initial policy, rollout
seconds and tokens/s, train seconds, weight-push seconds, and ``mismatch_train`` = max |the trainer's
logprob - the engine's rollout logprob| over the step's completion tokens (0 exactly; a server flag that
breaks the agreement, e.g. ``--server-arg=--kv-cache-dtype=fp8_e4m3``, shows here as a non-zero value).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch


# --------------------------------------------------------------------------------------------------
# the task and its reward
# --------------------------------------------------------------------------------------------------
def make_question(rng: random.Random, max_operand: int = 9) -> tuple[str, int]:
    """A question "What is a + b?" with a, b in [0, max_operand] and its answer a + b."""
    a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
    return f"What is {a} + {b}? Answer with just the number.", a + b


def reward(text: str, answer: int) -> float:
    """Verifiable reward: 1.0 when the first integer in ``text`` is ``answer``, plus 0.5 for the asked
    format (the answer starts with a number); so 1.5, 1.0, 0.5 or 0.0."""
    m = re.search(r"-?\d+", text)
    correct = 1.0 if m is not None and int(m.group()) == answer else 0.0
    return correct + (0.5 if re.match(r"\s*-?\d", text) else 0.0)


def group_advantages(rewards: torch.Tensor, eps: float = 1e-4) -> torch.Tensor:
    """GRPO's outcome advantages: rewards [P, G] (P prompts, G samples each) normalised within each group,
    (r - mean) / (std + eps); a group whose samples all scored alike gets 0 advantages. float32 [P, G]."""
    mean = rewards.mean(1, keepdim=True)
    std = rewards.std(1, keepdim=True, unbiased=False)
    return ((rewards - mean) / (std + eps)).float()


def grpo_loss(logp: torch.Tensor, old_logp: torch.Tensor, ref_logp: torch.Tensor, adv: torch.Tensor,
              mask: torch.Tensor, clip: float, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO's per-token objective (DeepSeekMath eq. 3), negated for minimisation, averaged over each
    sequence's tokens then over sequences. logp (with grad), old_logp (the rollout's), ref_logp (initial
    policy's), mask: [B, T] float32 (mask 1 on completion tokens); adv: [B]. KL is the k3 estimator
    exp(ref - logp) - (ref - logp) - 1 (Schulman). Returns (loss, mean KL per token)."""
    ratio = torch.exp(logp - old_logp)
    a = adv[:, None]
    surrogate = torch.minimum(ratio * a, ratio.clamp(1 - clip, 1 + clip) * a)
    d = ref_logp - logp
    kl = torch.exp(d) - d - 1
    per_token = -(surrogate - beta * kl)
    n = mask.sum(1).clamp(min=1)
    loss = ((per_token * mask).sum(1) / n).mean()
    return loss, ((kl * mask).sum() / mask.sum().clamp(min=1)).detach()


# --------------------------------------------------------------------------------------------------
# rollouts from the engine (an Idleless server in a subprocess)
# --------------------------------------------------------------------------------------------------
def rollout(http, url: str, prompt_ids: list[int], group: int, max_new: int, seed: int) -> list[dict]:
    """``group`` samples of one prompt: each {"ids": completion ids, "logprobs": engine logprobs, "text"}."""
    r = http.post(url + "/generate", json={"input_ids": prompt_ids, "return_logprob": True, "sampling_params": {
        "n": group, "temperature": 1.0, "max_new_tokens": max_new, "seed": seed}}, timeout=600)
    r.raise_for_status()
    outs = r.json()
    outs = outs if isinstance(outs, list) else [outs]
    return [{"ids": o["output_ids"], "logprobs": [e[0] for e in o["meta_info"]["output_token_logprobs"]],
             "text": o["text"]} for o in outs]


# --------------------------------------------------------------------------------------------------
# the trainer
# --------------------------------------------------------------------------------------------------
def pad(rows: list, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sequence completion values (lists or 1-D tensors, with grad kept) right-padded into [B, width]
    float32, and the mask [B, width] (1 on a sequence's own tokens)."""
    vals = torch.stack([torch.cat([torch.as_tensor(r, dtype=torch.float32),
                                   torch.zeros(width - len(r))]) for r in rows])
    mask = torch.stack([(torch.arange(width) < len(r)).float() for r in rows])
    return vals, mask


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="HF model directory (default: the bundled SmolLM2-135M-Instruct)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--prompts", type=int, default=4, help="questions per step")
    ap.add_argument("--group-size", type=int, default=8, help="samples per question (GRPO's G)")
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--lr", type=float, default=5e-6)
    ap.add_argument("--beta", type=float, default=0.04, help="KL coefficient")
    ap.add_argument("--clip", type=float, default=0.2)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--engine-threads", type=int, default=1)
    ap.add_argument("--trainer-threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="grpo-run", help="output prefix: <out>.jsonl and <out>.png")
    ap.add_argument("--server-arg", action="append", default=[], help="extra `idleless serve` argument")
    args = ap.parse_args(argv)

    import httpx

    from idleless.config import EngineConfig
    from idleless.model.loader import prepare_model_dir
    from idleless.model.runner import ModelRunner
    from idleless.rl.policy import KernelPolicy
    from idleless.rl.scoring import SequenceScorer
    from idleless.rl.trainer import WeightPusher, free_port, start_server
    from idleless.text.tokenizer import Tokenizer

    torch.manual_seed(args.seed)
    torch.set_num_threads(args.trainer_threads)
    rng = random.Random(args.seed)
    model_dir = prepare_model_dir(args.model)
    tok = Tokenizer.load(model_dir)
    trainer_cfg = EngineConfig(model=model_dir, dtype="float32", kv_cache_memory="8MiB",
                               enable_deterministic_inference=True, num_threads=args.trainer_threads)
    policy = KernelPolicy(trainer_cfg)
    opt = torch.optim.AdamW(policy.parameters(), lr=args.lr, weight_decay=0.0)
    reference = SequenceScorer(ModelRunner(trainer_cfg))  # the initial policy, for the KL term (no grad)

    proc, url = start_server(model_dir, ["--dtype", "float32", "--enable-deterministic-inference", "--num-threads",
                                         str(args.engine_threads), "--log-level", "warning", *args.server_arg])
    http = httpx.Client(timeout=600)
    pusher = WeightPusher(url, timeout_s=600)
    log_path = args.out + ".jsonl"
    os.makedirs(os.path.dirname(os.path.abspath(log_path)), exist_ok=True)
    records = []
    try:
        pusher.init_group("127.0.0.1", free_port())
        for step in range(1, args.steps + 1):
            questions = [make_question(rng) for _ in range(args.prompts)]
            prompts = [tok.apply_chat_template([{"role": "user", "content": q}]) for q, _ in questions]
            t0 = time.perf_counter()
            with ThreadPoolExecutor(len(prompts)) as pool:
                groups = list(pool.map(lambda ip: rollout(http, url, ip[1], args.group_size, args.max_new_tokens,
                                                          args.seed * 100003 + step * 1000 + ip[0]),
                                       enumerate(prompts)))
            rollout_s = time.perf_counter() - t0
            gen_tokens = sum(len(s["ids"]) for g in groups for s in g)
            rewards = torch.tensor([[reward(s["text"], ans) for s in g] for g, (_, ans) in zip(groups, questions)])
            adv = group_advantages(rewards).reshape(-1)
            seqs = [(p, s) for p, g in zip(prompts, groups) for s in g]

            t0 = time.perf_counter()
            pairs = [(p, s["ids"]) for p, s in seqs]
            ref_lp = reference.score(pairs)
            score_s = time.perf_counter() - t0

            t0 = time.perf_counter()
            opt.zero_grad()
            kl_sum, mismatch_train, n_seq = 0.0, 0.0, len(seqs)
            width = max(len(s["ids"]) for _, s in seqs)
            for a in range(0, n_seq, args.micro_batch):
                b = min(a + args.micro_batch, n_seq)
                logp, mask = pad(policy.logprobs(pairs[a:b]), width)  # the engine's kernels, differentiable
                old, _ = pad([s["logprobs"] for _, s in seqs[a:b]], width)
                ref, _ = pad(ref_lp[a:b], width)
                loss, kl = grpo_loss(logp, old, ref, adv[a:b], mask, args.clip, args.beta)
                (loss * (b - a) / n_seq).backward()
                kl_sum += float(kl) * (b - a)
                mismatch_train = max(mismatch_train, float(((logp.detach() - old).abs() * mask).max()))
            opt.step()
            train_s = time.perf_counter() - t0

            t0 = time.perf_counter()
            pushed = pusher.push_distributed(policy.named_tensors(), weight_version=f"step-{step}")
            push_s = time.perf_counter() - t0
            rec = {"step": step, "reward": float(rewards.mean()), "kl": kl_sum / n_seq,
                   "rollout_s": rollout_s, "rollout_tokens_per_s": gen_tokens / rollout_s, "train_s": train_s,
                   "score_s": score_s, "push_s": push_s, "engine_write_s": pushed["seconds"],
                   "mismatch_train": mismatch_train, "weight_version": pushed["weight_version"]}
            records.append(rec)
            with open(log_path, "a") as f:
                f.write(json.dumps(rec) + "\n")
            print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in rec.items()),
                  flush=True)
        pusher.destroy_group()
    finally:
        pusher.close()
        http.close()
        proc.terminate()
        proc.wait(60)
    plot(records, args.out + ".png")
    return 0


def plot(records: list[dict], path: str) -> None:
    """Reward, KL, the logprob mismatches and the per-step seconds, one panel each, into ``path``."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    steps = [r["step"] for r in records]
    fig, ax = plt.subplots(2, 2, figsize=(10, 7))
    ax[0, 0].plot(steps, [r["reward"] for r in records], marker="o")
    ax[0, 0].set_title("mean reward")
    ax[0, 1].plot(steps, [r["kl"] for r in records], marker="o")
    ax[0, 1].set_title("KL to the initial policy (k3, per token)")
    ax[1, 0].plot(steps, [r["mismatch_train"] for r in records], marker="s")
    ax[1, 0].set_title("max |train logprob - rollout logprob|")
    for key in ("rollout_s", "train_s", "push_s"):
        ax[1, 1].plot(steps, [r[key] for r in records], marker="o", label=key)
    ax[1, 1].set_title("seconds per step")
    ax[1, 1].legend(fontsize=8)
    for a in ax.flat:
        a.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    sys.exit(main())
