"""Tiny Llama target/draft pairs built locally (no downloads), for tests and CPU benchmarks.

    python -m tests.rigs.tiny_models OUT_DIR [--kind perturbed|truncated]
        [--noise X | --draft-noise X] [--measure]

Both kinds share a byte-level BPE tokenizer trained here on a few sentences.

* ``perturbed`` (tests): a 4-layer target and a draft that is the target with Gaussian
  noise added to every weight (``noise`` × that tensor's standard deviation). Noise 0
  gives 100 % acceptance; larger noise lowers it smoothly, so acceptance can be placed in
  a middle range. The draft costs as much as the target, so this pair proves
  correctness, not speed.
* ``truncated`` (benchmarks: a CPU stand-in for a target/draft pair): an 8-layer
  target whose layers from ``keep_layers`` upward are damped residual blocks (output
  projections × ``damping``), and a draft made of its first ``keep_layers`` layers with
  the same embeddings, norm and head — about 4× cheaper and mostly in agreement.

Writing is idempotent: an existing pair with the same recipe is reused. ``--measure``
prints the pair's greedy acceptance per γ (transformers on CPU, a few seconds).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "hello world this is a tiny test model for vllm speculative decoding",
    "one two three four five six seven eight nine ten",
    "a b c d e f g h i j k l m n o p q r s t u v w x y z",
    "speculative decoding uses a draft model to propose tokens",
    "the target model verifies the proposed tokens in one forward pass",
]
RECIPE_FILE = "nightjar_recipe.json"


@dataclasses.dataclass(frozen=True)
class Recipe:
    kind: str = "perturbed"
    noise: float = 0.02
    hidden: int = 256
    layers: int = 4
    intermediate: int = 512
    heads: int = 4
    keep_layers: int = 2
    damping: float = 0.05
    seed: int = 0

    @classmethod
    def for_kind(cls, kind: str, **overrides: Any) -> Recipe:
        if kind == "truncated":
            base = cls(kind="truncated", hidden=1024, layers=8, intermediate=4096, heads=16)
        elif kind == "perturbed":
            base = cls()
        else:
            raise ValueError(f"unknown kind {kind!r}: perturbed or truncated")
        return dataclasses.replace(base, **{k: v for k, v in overrides.items() if v is not None})


@dataclasses.dataclass(frozen=True)
class ModelPair:
    target: Path
    draft: Path


def build_tokenizer() -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        special_tokens=["<unk>", "<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS * 20, trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
    )
    hf.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    )
    return hf


def _config(recipe: Recipe, tokenizer: Any, layers: int) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=recipe.hidden,
        intermediate_size=recipe.intermediate,
        num_hidden_layers=layers,
        num_attention_heads=recipe.heads,
        num_key_value_heads=recipe.heads,
        max_position_embeddings=2048,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )


def build(out_dir: str | Path, recipe: Recipe) -> ModelPair:
    """Write the target and draft under ``out_dir`` (reused when the recipe matches)."""
    out = Path(out_dir)
    pair = ModelPair(out / "target", out / "draft")
    stamp = out / RECIPE_FILE
    if stamp.exists() and json.loads(stamp.read_text()) == dataclasses.asdict(recipe):
        return pair

    import torch
    from transformers import LlamaForCausalLM

    tokenizer = build_tokenizer()
    torch.manual_seed(recipe.seed)
    target = LlamaForCausalLM(_config(recipe, tokenizer, recipe.layers)).to(torch.float32)
    if recipe.kind == "perturbed":
        draft = LlamaForCausalLM(_config(recipe, tokenizer, recipe.layers)).to(torch.float32)
        generator = torch.Generator().manual_seed(recipe.seed + 1)
        with torch.no_grad():
            for source, weight in zip(
                target.state_dict().values(), draft.state_dict().values(), strict=True
            ):
                scale = recipe.noise * float(source.float().std()) if source.numel() > 1 else 0.0
                noise = torch.randn(source.shape, generator=generator) * scale
                weight.copy_(source + noise.to(source.dtype))
    else:
        with torch.no_grad():
            for index, layer in enumerate(target.model.layers):
                if index >= recipe.keep_layers:
                    layer.self_attn.o_proj.weight.mul_(recipe.damping)
                    layer.mlp.down_proj.weight.mul_(recipe.damping)
        draft = LlamaForCausalLM(_config(recipe, tokenizer, recipe.keep_layers)).to(torch.float32)
        # Embeddings, the first layers, the final norm and the head, taken from the target.
        draft.load_state_dict(target.state_dict(), strict=False)
    for model, path in ((target, pair.target), (draft, pair.draft)):
        model.save_pretrained(path, safe_serialization=True)
        tokenizer.save_pretrained(path)
    stamp.write_text(json.dumps(dataclasses.asdict(recipe)))
    return pair


def greedy_agreement(pair: ModelPair, new_tokens: int = 32) -> list[list[bool]]:
    """Per prompt, per generated position: does the draft's greedy token equal the
    target's, given the target's greedy prefix? Under greedy verification this is exactly
    what decides acceptance (an accepted draft token *is* the target's token)."""
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(pair.target)
    target = LlamaForCausalLM.from_pretrained(pair.target, torch_dtype=torch.float32).eval()
    draft = LlamaForCausalLM.from_pretrained(pair.draft, torch_dtype=torch.float32).eval()
    agreement = []
    with torch.no_grad():
        for sentence in CORPUS:
            prompt = tokenizer(" ".join(sentence.split()[:4]), return_tensors="pt").input_ids
            sequence = target.generate(
                prompt,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
            )
            start = prompt.shape[1]
            # Logits at position t predict token t + 1.
            predicted = draft(sequence).logits[0, start - 1 : -1].argmax(-1)
            agreement.append((predicted == sequence[0, start:]).tolist())
    return agreement


def acceptance_rate(agreement: list[list[bool]], gamma: int) -> float:
    """Accepted / drafted tokens of greedy speculative decoding at a fixed γ, one request
    at a time: each step drafts γ, accepts the run of agreeing positions (≤ γ) and
    advances past it plus the target's bonus / corrected token. A cheap preview: vLLM's
    own counters are the reference."""
    accepted = drafted = 0
    for row in agreement:
        position = 0
        while position < len(row):
            run = 0
            while run < gamma and position + run < len(row) and row[position + run]:
                run += 1
            # Near the end only the remaining positions can be drafted usefully.
            accepted, drafted = accepted + run, drafted + min(gamma, len(row) - position)
            position += run + 1
    return accepted / drafted if drafted else 0.0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tiny-models", description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--kind", default="perturbed", choices=("perturbed", "truncated"))
    parser.add_argument(
        "--noise",
        "--draft-noise",
        dest="noise",
        type=float,
        help="perturbed: relative weight noise",
    )
    parser.add_argument("--damping", type=float, help="truncated: upper-layer output scale")
    parser.add_argument("--seed", type=int)
    parser.add_argument(
        "--measure", action="store_true", help="print the draft's greedy acceptance per γ"
    )
    args = parser.parse_args(argv)
    recipe = Recipe.for_kind(args.kind, noise=args.noise, damping=args.damping, seed=args.seed)
    pair = build(args.out, recipe)
    print(f"target: {pair.target}\ndraft:  {pair.draft}")
    if args.measure:
        agreement = greedy_agreement(pair)
        per_token = sum(map(sum, agreement)) / sum(map(len, agreement))
        rates = ", ".join(f"γ={g}: {acceptance_rate(agreement, g):.2f}" for g in (1, 2, 3, 4))
        print(
            f"draft agrees with the target on {per_token:.2f} of greedy tokens; "
            f"acceptance (accepted / drafted) {rates}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
