"""Tiny Llama target/draft pairs built locally (no downloads), for tests and CPU benchmarks.

    python -m tests.rigs.tiny_models OUT_DIR [--kind perturbed|truncated]
        [--noise X | --draft-noise X] [--measure] [--eagle3] [--mtp]

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

Drafters that read the target's hidden states, for a target built here (``--eagle3``,
``--mtp``: written next to the pair, under ``eagle3`` and ``mtp-target``):

* ``build_eagle3_head``: an EAGLE-3 head (vLLM's ``LlamaForCausalLMEagle3``: one decoder
  layer fed by three of the target's layers, its own smaller draft vocabulary with a
  ``d2t`` map, the target's embeddings shared), trained for a few seconds on the target's
  greedy continuations of the corpus' prompts, so that it drafts what the target says.
* ``build_mtp_target``: the target as a MiMo model (vLLM's ``MiMoForCausalLM``: Qwen2 with
  multi-token-prediction layers; zero q/k/v biases make it compute what the Llama target
  computes) with one MTP layer for vLLM's ``mtp`` method.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import sys
from collections.abc import Iterator, Sequence
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
WEIGHTS_FILE = "model.safetensors"


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


def _weights_digest(model_dir: Path) -> str:
    """What a drafter built for ``model_dir`` depends on: a rebuilt target invalidates it."""
    return hashlib.sha256((model_dir / WEIGHTS_FILE).read_bytes()).hexdigest()


def _stamped(out: Path, recipe: dict[str, Any]) -> bool:
    stamp = out / RECIPE_FILE
    return stamp.exists() and json.loads(stamp.read_text()) == recipe


def _target_continuations(
    target: Any, tokenizer: Any, prompt_words: Sequence[int], new_tokens: int
) -> tuple[Any, Any, int]:
    """The target's greedy continuations of the corpus lines' first ``prompt_words`` words
    (the tests' prompts are among them): (token ids, attention mask, prompt width), one
    row per prompt, prompts left-padded to one width."""
    import torch

    prompts = [" ".join(line.split()[:words]) for line in CORPUS for words in prompt_words]
    tokenizer.padding_side = "left"
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    with torch.no_grad():
        tokens = target.generate(
            **batch,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
        )
    generated = torch.ones(len(prompts), new_tokens, dtype=batch.attention_mask.dtype)
    mask = torch.cat([batch.attention_mask, generated], dim=1)
    return tokens, mask, batch.input_ids.shape[1]


@contextlib.contextmanager
def _one_torch_thread() -> Iterator[None]:
    """Torch on one thread meanwhile: these tensors are small, and on a busy 2-core host
    a second thread's waits at every operation made the head's training 5× slower."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _rms_norm(x: Any, weight: Any, eps: float) -> Any:
    import torch

    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


@dataclasses.dataclass(frozen=True)
class Eagle3Recipe:
    """How build_eagle3_head makes a head: its shape and its few seconds of training."""

    # The target layers whose outputs feed the head (vLLM's aux hidden states: the
    # residual stream after that many layers); None: low, middle and last.
    aux_layers: tuple[int, ...] | None = None
    draft_vocab: int = 256  # below the target's: exercises vLLM's d2t mapping
    depth: int = 3  # draft positions trained (Γmax of the tests)
    prompt_words: tuple[int, ...] = (4, 5, 6)  # training prompts: the lines' first words
    new_tokens: int = 48  # greedy tokens per training prompt
    train_steps: int = 40
    learning_rate: float = 1e-2
    seed: int = 0


def build_eagle3_head(
    out_dir: str | Path, target_dir: str | Path, recipe: Eagle3Recipe | None = None
) -> Path:
    """Write an EAGLE-3 head for the Llama ``target_dir`` into ``out_dir`` (reused when the
    recipe and the target match) and return ``out_dir``: vLLM's ``method: eagle3`` loads it.

    vLLM's head is one Llama layer over [embedding of the next token ; fc(aux hidden
    states)], a final norm and an lm_head over the draft vocabulary; each further draft
    position feeds the layer its own previous output. Here its attention output projection
    is zero, so the layer is the residual stream fc(aux) plus its MLP, and each position
    adds one more MLP pass: that path alone is trained (full-batch Adam, a few seconds),
    with no attention to reimplement, to map the target's hidden states to its next
    ``depth`` greedy tokens. The weights carry the checkpoint names vLLM maps
    (``midlayer.*``, ``fc``, ``norm``, ``lm_head``, ``d2t``, ``t2d``) and no embeddings, so
    vLLM shares the target's, as with published heads.
    """
    recipe = recipe or Eagle3Recipe()
    out, target_path = Path(out_dir), Path(target_dir)
    stamp = {
        "kind": "eagle3",
        "target": _weights_digest(target_path),
        **dataclasses.asdict(recipe),
    }
    # As JSON reads it back (lists), so that an unchanged recipe matches its stamp.
    stamp = json.loads(json.dumps(stamp))
    if _stamped(out, stamp):
        return out

    from safetensors.torch import save_file

    with _one_torch_thread():
        weights, config = _eagle3_head(target_path, recipe)
    out.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / RECIPE_FILE).write_text(json.dumps(stamp))
    return out


def _eagle3_head(target_path: Path, recipe: Eagle3Recipe) -> tuple[dict[str, Any], dict[str, Any]]:
    """The head's checkpoint tensors and config.json for the target."""
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(target_path)
    target = LlamaForCausalLM.from_pretrained(target_path, dtype=torch.float32).eval()
    config = target.config
    hidden, vocab = config.hidden_size, config.vocab_size
    layers = config.num_hidden_layers
    aux_layers = recipe.aux_layers or (1, layers // 2, layers)
    tokens, mask, width = _target_continuations(
        target, tokenizer, recipe.prompt_words, recipe.new_tokens
    )

    # The residual stream after layer k, for every position of every continuation.
    after: dict[int, Any] = {}
    hooks = [
        layer.register_forward_hook(
            lambda _m, _i, output, k=index + 1: after.__setitem__(
                k, output[0] if isinstance(output, tuple) else output
            )
        )
        for index, layer in enumerate(target.model.layers)
    ]
    with torch.no_grad():
        target(tokens, attention_mask=mask)
    for hook in hooks:
        hook.remove()
    aux = torch.cat([after[k] for k in aux_layers], dim=-1)
    # Position t (holding token t) with the next token t + 1 already sampled drafts
    # tokens t + 2 … t + 1 + depth: from the prompt's last position on.
    depth, end = recipe.depth, tokens.shape[1]
    features = aux[:, width - 1 : end - 1 - depth].reshape(-1, aux.shape[-1])
    labels = torch.stack(
        [tokens[:, width + 1 + k : end - depth + 1 + k] for k in range(depth)], dim=-1
    ).reshape(-1, depth)

    # The draft vocabulary: the target's most frequent generated tokens, in id order.
    counts = torch.bincount(tokens[:, width:].reshape(-1), minlength=vocab)
    ranked = torch.argsort(counts, descending=True, stable=True)
    draft_ids = torch.sort(ranked[: recipe.draft_vocab]).values
    to_draft = torch.full((vocab,), -100, dtype=torch.long)  # -100: cross_entropy ignores
    to_draft[draft_ids] = torch.arange(len(draft_ids))

    generator = torch.Generator().manual_seed(recipe.seed)

    def random(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * 0.02

    intermediate = config.intermediate_size
    weights = {
        "fc.weight": random(hidden, aux.shape[-1]),
        "midlayer.post_attention_layernorm.weight": torch.ones(hidden),
        "midlayer.mlp.gate_proj.weight": random(intermediate, hidden),
        "midlayer.mlp.up_proj.weight": random(intermediate, hidden),
        "midlayer.mlp.down_proj.weight": random(hidden, intermediate),
        "norm.weight": torch.ones(hidden),
        "lm_head.weight": random(len(draft_ids), hidden),
    }
    _train_eagle3_path(weights, features, to_draft[labels], config.rms_norm_eps, recipe)
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    kv = config.num_key_value_heads * head_dim
    weights |= {
        # Attention reads [embedding ; hidden] (2 × hidden wide); its output is switched off.
        "midlayer.self_attn.q_proj.weight": random(heads * head_dim, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": random(kv, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": random(kv, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": torch.zeros(hidden, heads * head_dim),
        "midlayer.input_layernorm.weight": torch.ones(hidden),
        "midlayer.hidden_norm.weight": torch.ones(hidden),
    }
    if len(draft_ids) < vocab:  # (vLLM has no map to load at the full vocabulary)
        # Draft index i is target token i + d2t[i]; t2d marks the target's tokens drafted.
        weights |= {"d2t": draft_ids - torch.arange(len(draft_ids)), "t2d": to_draft >= 0}
    head_config = config.to_dict() | {
        "architectures": ["LlamaForCausalLMEagle3"],
        "num_hidden_layers": 1,
        "draft_vocab_size": len(draft_ids),
        "target_hidden_size": hidden,
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": list(aux_layers),
            "use_aux_hidden_state": True,
        },
    }
    return weights, head_config


def _train_eagle3_path(
    weights: dict[str, Any], features: Any, labels: Any, eps: float, recipe: Eagle3Recipe
) -> None:
    """Fit ``weights`` (in place) so that draft position k of the head, computed as vLLM
    computes it with the attention output zero, predicts ``labels[:, k]`` (-100: none)."""
    import torch
    import torch.nn.functional as F

    params = {name: torch.nn.Parameter(value) for name, value in weights.items()}
    optimizer = torch.optim.Adam(list(params.values()), lr=recipe.learning_rate)
    post_norm, norm = params["midlayer.post_attention_layernorm.weight"], params["norm.weight"]
    gate, up = params["midlayer.mlp.gate_proj.weight"], params["midlayer.mlp.up_proj.weight"]
    down, head = params["midlayer.mlp.down_proj.weight"], params["lm_head.weight"]
    for _ in range(recipe.train_steps):
        state, loss = features @ params["fc.weight"].T, torch.zeros(())
        for k in range(recipe.depth):
            normed = _rms_norm(state, post_norm, eps)
            # The layer's output: its residual (the input) + its MLP; the next position's
            # input is that output.
            state = state + (F.silu(normed @ gate.T) * (normed @ up.T)) @ down.T
            logits = _rms_norm(state, norm, eps) @ head.T
            loss = loss + F.cross_entropy(logits, labels[:, k], ignore_index=-100)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    weights.update({name: param.detach() for name, param in params.items()})


def build_mtp_target(out_dir: str | Path, target_dir: str | Path) -> Path:
    """Write the Llama ``target_dir`` as a MiMo model with one MTP layer into ``out_dir``
    (reused when the target matches) and return ``out_dir``: vLLM's ``method: mtp``.

    MiMo is Qwen2 (q/k/v biases) plus ``num_nextn_predict_layers`` MTP layers; with zero
    biases and the Llama weights it computes what the target computes, so its greedy
    output is the target's. The MTP layer is built, not trained: its input projection
    keeps the target's hidden state and drops the next token, its block adds nothing
    (output projections zero) and the target's final norm and head follow, so it drafts
    the token the target has just produced again, γ times: right wherever the target
    repeats a token, which these random targets do often (about half their greedy tokens).
    """
    out, target_path = Path(out_dir), Path(target_dir)
    stamp = {"kind": "mtp", "layer": "repeat", "target": _weights_digest(target_path)}
    if _stamped(out, stamp):
        return out

    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer, LlamaConfig, Qwen2Config

    llama = LlamaConfig.from_pretrained(target_path)
    weights = load_file(str(target_path / WEIGHTS_FILE))
    hidden = llama.hidden_size
    for name in list(weights):
        if name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight")):
            weights[name.removesuffix("weight") + "bias"] = torch.zeros(weights[name].shape[0])
    mtp = "model.mtp_layers.0."
    first = "model.layers.0."
    weights |= {
        mtp + name[len(first) :]: (
            torch.zeros_like(value)
            if name.endswith(("o_proj.weight", "down_proj.weight"))
            else value.clone()
        )
        for name, value in weights.items()
        if name.startswith(first)
    }
    weights |= {
        mtp + "token_layernorm.weight": torch.ones(hidden),
        mtp + "hidden_layernorm.weight": torch.ones(hidden),
        # input_proj reads [hidden state ; token]: the hidden state only.
        mtp + "input_proj.weight": torch.cat(
            [torch.eye(hidden), torch.zeros(hidden, hidden)], dim=1
        ),
        mtp + "final_layernorm.weight": weights["model.norm.weight"].clone(),
    }
    config = Qwen2Config(
        vocab_size=llama.vocab_size,
        hidden_size=hidden,
        intermediate_size=llama.intermediate_size,
        num_hidden_layers=llama.num_hidden_layers,
        num_attention_heads=llama.num_attention_heads,
        num_key_value_heads=llama.num_key_value_heads,
        max_position_embeddings=llama.max_position_embeddings,
        rms_norm_eps=llama.rms_norm_eps,
        rope_parameters=llama.rope_parameters,
        bos_token_id=llama.bos_token_id,
        eos_token_id=llama.eos_token_id,
        pad_token_id=llama.pad_token_id,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    config.architectures = ["MiMoForCausalLM"]
    config.num_nextn_predict_layers = 1
    out.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    config.save_pretrained(out)
    AutoTokenizer.from_pretrained(target_path).save_pretrained(out)
    (out / RECIPE_FILE).write_text(json.dumps(stamp))
    return out


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
    parser.add_argument(
        "--eagle3", action="store_true", help="also an EAGLE-3 head for the target: OUT/eagle3"
    )
    parser.add_argument(
        "--mtp", action="store_true", help="also the target with an MTP layer: OUT/mtp-target"
    )
    args = parser.parse_args(argv)
    recipe = Recipe.for_kind(args.kind, noise=args.noise, damping=args.damping, seed=args.seed)
    pair = build(args.out, recipe)
    print(f"target: {pair.target}\ndraft:  {pair.draft}")
    if args.eagle3:
        print(f"eagle3: {build_eagle3_head(args.out / 'eagle3', pair.target)}")
    if args.mtp:
        print(f"mtp:    {build_mtp_target(args.out / 'mtp-target', pair.target)}")
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
