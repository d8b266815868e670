"""How often the draft's greedy token is the target's, and what the draft's runner-up tokens
would add as branches of the token tree (no engine: Hugging Face models on the host).

The target writes each prompt's greedy continuation; the draft, teacher-forced on the same
text, gives its top-3 at every position. Printed: the draft's agreement per position, the
share of its misses that its 2nd (2nd or 3rd) choice would catch, and, over rounds of gamma
draft tokens from each accepted position (chain drafting, no pool), the share of rounds that
reject inside the draft and how often the runner-up is the target's correction there. A
runner-up branch at the rejected position adds one token (the target's output after it) plus
whatever a pool phrase after it would add, so this bounds what such branches can give.

    python scripts/draft_agreement.py --prompts 8 --max-tokens 128 --gamma 4
"""
import argparse

import torch

from generate import humaneval_prompts, models_dir


def draft_topk(draft, seq: torch.Tensor, target_vocab: int, k: int = 3) -> torch.Tensor:
    """[len(seq), k] the draft's top-k ids after each prefix of seq (a 1-D LongTensor of the
    target's ids), as the engine fits a draft with another embedding size (DraftModel.fit_vocab):
    target ids past the draft's rows read as its last row; it chooses among the ids both have."""
    rows = draft.get_input_embeddings().weight.shape[0]
    with torch.no_grad():
        logits = draft(seq.clamp(max=rows - 1)[None]).logits[0, :, :min(rows, target_vocab)]
    return logits.topk(k, -1).indices


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=8, help="first N HumanEval prompts")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--gamma", type=int, default=4, help="draft tokens per simulated round")
    ap.add_argument("--target", default=str(models_dir() / "qwen2.5-coder-1.5b-instruct"))
    ap.add_argument("--draft", default=str(models_dir() / "qwen2.5-coder-0.5b-instruct"))
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    prompts = humaneval_prompts(args.prompts)
    tok = AutoTokenizer.from_pretrained(args.target)
    load = lambda p: AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).eval()  # noqa: E731
    target, draft = load(args.target), load(args.draft)
    target_vocab = target.get_output_embeddings().weight.shape[0]

    positions = misses = top2 = top23 = rounds = rejects = rej2 = rej23 = accepted = 0
    for prompt in prompts:
        ids = tok(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            seq = target.generate(ids, max_new_tokens=args.max_tokens, do_sample=False)[0]
        top = draft_topk(draft, seq, target_vocab)  # top[j] predicts seq[j + 1]
        first, last = ids.shape[1] - 1, len(seq) - 1
        for j in range(first, last):
            positions += 1
            if top[j, 0] != seq[j + 1]:
                misses += 1
                top2 += int(top[j, 1] == seq[j + 1])
                top23 += int(seq[j + 1] in top[j, 1:])
        j = first
        while j < last:  # one round: gamma draft tokens from j, accepted up to the first miss
            rounds += 1
            i = 0
            while i < args.gamma and j + i < last and top[j + i, 0] == seq[j + i + 1]:
                i += 1
            if i < args.gamma and j + i < last:
                rejects += 1
                rej2 += int(top[j + i, 1] == seq[j + i + 1])
                rej23 += int(seq[j + i + 1] in top[j + i, 1:])
            accepted += i + 1
            j += i + 1
    print(f"{len(prompts)} prompts, {positions} target tokens")
    print(f"draft agrees with the target at {1 - misses / positions:.3f} of positions; of its "
          f"{misses} misses, its 2nd choice is the target's at {top2 / max(misses, 1):.3f}, its 2nd or 3rd "
          f"at {top23 / max(misses, 1):.3f}")
    print(f"rounds of gamma = {args.gamma}: {rounds}, tokens per round {accepted / rounds:.2f} "
          f"(bonus included); rounds rejecting inside the draft {rejects / rounds:.3f}; runner-up "
          f"= correction there {rej2 / max(rejects, 1):.3f} (2nd or 3rd {rej23 / max(rejects, 1):.3f}); "
          f"a runner-up branch per draft position adds >= {rej2 / rounds:.3f} tokens per round")


if __name__ == "__main__":
    main()
