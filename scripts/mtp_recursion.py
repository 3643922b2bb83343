"""An experiment on the trained demo's MTP layer (its weights are not shipped): fine-tune the shipped layer on
its own recursion and measure real draft rounds before and after.

    .venv/bin/python scripts/mtp_recursion.py [--steps 200] [--depth 3] [--lr 5e-4]

The shipped head was trained teacher-forced at depth 1 only (docs/train_demo.md §3): row p reads (t_{p+1},
h_p). Drafting k > 1 feeds the layer its own output instead of h. Here depth k (1..D) is trained the way it
drafts: x_k at position p = layer(t_{p+k}, x_{k-1} at p-1), x_0 = the trunk's hidden, each depth against
the trunk's distribution for token p+k+1 (soft cross-entropy, weights 1, 0.8, 0.6, 0.4), trunk frozen,
batches of 4 training windows of 512 tokens, AdamW with train_demo's schedule. Acceptance is train_demo's
`draft_rounds` (64 rounds on held-out code against the trunk's greedy continuation, seed 6) before and after,
with the layer rounded to its stored bf16.
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_demo as td  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--steps", type=int, default=200)
ap.add_argument("--depth", type=int, default=3, choices=[1, 2, 3, 4])
ap.add_argument("--lr", type=float, default=5e-4)
a = ap.parse_args()
torch.set_num_threads(1)
td.use_fast_kda()
STEPS, D, LR, B = a.steps, a.depth, a.lr, 4
folder = Path(__file__).resolve().parents[1] / "moesaic" / "demo" / "trained" / "glm5-code"
trunk, mtp, config = td.load_target(folder)
drafter = td.load_drafter(folder.parent / "glm5-code-dflash")
docs, corpus = td.read_corpus(None)
train_docs, held_docs, _ = td.split_documents(docs)
tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
train, held_all = (
    td.windows(td.token_stream(tok, train_docs), 512),
    td.windows(td.token_stream(tok, held_docs), 512),
)
t0 = time.time()
base = td.draft_rounds(trunk, mtp, drafter, held_all, torch.Generator().manual_seed(6))
print(
    "before",
    json.dumps({k: base[k] for k in ("mtp_acceptance", "mtp_tau_k1", "mtp_tau_k3")}),
    f"{time.time() - t0:.0f}s",
    flush=True,
)
for p in trunk.parameters():
    p.requires_grad_(False)
params = [p for p in mtp.parameters()]
opt = td.adamw(params, LR)
g = torch.Generator().manual_seed(11)
weights = [1.0, 0.8, 0.6, 0.4][:D]
mtp.train()
for step in range(STEPS):
    ids = train[torch.randint(len(train), (B,), generator=g)]
    for group in opt.param_groups:
        group["lr"] = td.lr_at(step, STEPS, LR, 20)
    with torch.no_grad():
        logits, h, _ = trunk(ids)
    x, loss, parts = h, 0.0, []
    for k in range(1, D + 1):
        x = mtp(trunk.embed(ids[:, k:]), x[:, :-1])  # position p: (t_{p+k}, previous depth's output at p-1)
        m_logits = trunk.lm_head(mtp.shared_head.norm(x[:, :-1]))
        l = td.soft_ce(m_logits, logits[:, k:-1]).mean()
        parts.append(l.item())
        loss = loss + weights[k - 1] * l
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    if (step + 1) % 25 == 0:
        print(
            f"step {step + 1} losses by depth {' '.join(f'{v:.3f}' for v in parts)} {(time.time() - t0) / 60:.1f} min",
            flush=True,
        )
mtp.eval()
td.round_to_stored([mtp])
after = td.draft_rounds(trunk, mtp, drafter, held_all, torch.Generator().manual_seed(6))
print("after", json.dumps({k: after[k] for k in ("mtp_acceptance", "mtp_tau_k1", "mtp_tau_k3")}), flush=True)
