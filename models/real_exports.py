"""Tiny decoders with a key/value cache exported by the real tools, committed under models/real/
(one folder per form, the files as the tool wrote them) for tests/test_real_exports.py.

Not needed by the tests: it needs torch and the exporters, installed in their own environments
(Optimum's release pins an older transformers than the torch.onnx and genai exports use):

    env A: torch==2.13.0 transformers==5.25.0 onnxscript==0.7.2 onnxruntime-genai==0.18.0 onnxruntime==1.32.0
    env B: torch==2.13.0 optimum-onnx==0.1.0 (optimum 2.1.0, transformers 4.57.6) onnxruntime==1.32.0

    B: python -m models.real_exports checkpoint CKPT     # the random Llama, save_pretrained
    B: python -m models.real_exports optimum CKPT        # optimum main_export, text-generation-with-past
    A: python -m models.real_exports torch CKPT          # torch.onnx.export(dynamo=True) of Llama and BitNet
    A: python -m models.real_exports genai CKPT          # onnxruntime_genai.models.builder -p fp32 / int4 -e cpu

Each writes models/real/FORM/ (FORM in FORMS). Nothing is downloaded: the configs are made here
and the weights drawn from a fixed seed."""
from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import click

REAL_DIR = Path(__file__).parent / "real"
SEED = 20
SHAPE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5, rope_theta=10000.0)
# logits far enough apart that a greedy choice does not hang on float rounding
INIT_RANGE = 0.1
FORMS = ("torch_llama", "torch_bitnet", "optimum_llama", "genai_fp32", "genai_int4")


def llama_config():
    from transformers import LlamaConfig
    return LlamaConfig(**SHAPE, initializer_range=INIT_RANGE, tie_word_embeddings=False,
                       bos_token_id=1, eos_token_id=2, pad_token_id=0)


@click.group()
def main():
    """Export the tiny decoders with the real tools."""


@main.command()
@click.argument("ckpt", type=click.Path(file_okay=False))
def checkpoint(ckpt):
    """The random Llama (seeded), saved with save_pretrained in CKPT."""
    import torch
    from transformers import LlamaForCausalLM
    torch.manual_seed(SEED)
    LlamaForCausalLM(llama_config()).eval().save_pretrained(ckpt)
    _tokenizer().save_pretrained(ckpt)


def _tokenizer():
    """A word-level tokenizer of the vocabulary's size: onnxruntime-genai's builder saves one beside the model."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {f"t{i}": i for i in range(SHAPE["vocab_size"])}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="t0", pad_token="t0", bos_token="t1",
                                   eos_token="t2")


def _fresh(form: str) -> Path:
    out = REAL_DIR / form
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    return out


@main.command()
@click.argument("ckpt", type=click.Path(exists=True, file_okay=False))
def optimum(ckpt):
    """optimum main_export(task="text-generation-with-past"), fp32, for CPU."""
    from optimum.exporters.onnx import main_export
    with tempfile.TemporaryDirectory() as tmp:
        main_export(ckpt, tmp, task="text-generation-with-past", device="cpu", no_post_process=False)
        out = _fresh("optimum_llama")
        for name in ("model.onnx", "model.onnx_data"):
            if (Path(tmp) / name).exists():
                shutil.copy(Path(tmp) / name, out / name)


@main.command()
@click.argument("ckpt", type=click.Path(exists=True, file_okay=False))
def genai(ckpt):
    """onnxruntime-genai's model builder at -p fp32 and -p int4, -e cpu."""
    for precision in ("fp32", "int4"):
        with tempfile.TemporaryDirectory() as tmp, tempfile.TemporaryDirectory() as cache:
            subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", ckpt, "-o", tmp,
                            "-p", precision, "-e", "cpu", "-c", cache], check=True)
            out = _fresh(f"genai_{precision}")
            for name in ("model.onnx", "model.onnx.data"):
                if (Path(tmp) / name).exists():
                    shutil.copy(Path(tmp) / name, out / name)


class WithCache:
    """A torch module around a causal LM whose inputs are the ids, the mask and the flat cache
    (``past_key_values.N.key/value``) and whose outputs are the logits and the flat ``present``."""

    @staticmethod
    def make(model, layers: int):
        import torch
        from transformers import DynamicCache

        class Module(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.model = model

            def forward(self, input_ids, attention_mask, *past):
                cache = DynamicCache(config=self.model.config)
                for i in range(layers):
                    cache.update(past[2 * i], past[2 * i + 1], i)
                out = self.model(input_ids=input_ids, attention_mask=attention_mask, past_key_values=cache,
                                 use_cache=True)
                present = [t for layer in out.past_key_values.layers for t in (layer.keys, layer.values)]
                return (out.logits, *present)
        return Module()


def _torch_export(model, config, out: Path) -> None:
    """torch.onnx.export(dynamo=True) with the sequence and the past symbolic (batch 1)."""
    import torch
    layers, kv = config.num_hidden_layers, config.num_key_value_heads
    head = config.hidden_size // config.num_attention_heads
    seq, past = 3, 4   # torch.export specializes sizes 0 and 1: trace at sizes above them
    ids = torch.randint(0, config.vocab_size, (1, seq))
    mask = torch.ones((1, past + seq), dtype=torch.int64)
    cache = [torch.randn(1, kv, past, head) for _ in range(2 * layers)]
    names = [f"past_key_values.{i}.{k}" for i in range(layers) for k in ("key", "value")]
    seq_dim, past_dim = torch.export.Dim("sequence_length", max=64), torch.export.Dim("past_sequence_length", max=120)
    # one past length for every layer; the mask's (past + sequence) found by export; *past is one element
    dynamic = ({1: seq_dim}, {1: torch.export.Dim.AUTO}, tuple({2: past_dim} for _ in names))
    with torch.no_grad():
        torch.onnx.export(WithCache.make(model, layers), (ids, mask, *cache), str(out / "model.onnx"), dynamo=True,
                          input_names=["input_ids", "attention_mask", *names],
                          output_names=["logits", *[n.replace("past_key_values", "present") for n in names]],
                          dynamic_shapes=dynamic)


def _bitnet(ckpt: str):
    """transformers' BitNetForCausalLM with offline AutoBitLinear projections (lm_head float), the
    Llama's shapes, ternary weights drawn from the seed."""
    import torch
    from transformers import BitNetConfig, BitNetForCausalLM
    from transformers.integrations.bitnet import replace_with_bitnet_linear
    from transformers.utils.quantization_config import BitNetQuantConfig
    shape = {k: v for k, v in SHAPE.items() if k != "rope_theta"}
    config = BitNetConfig(**shape, rope_parameters={"rope_type": "default", "rope_theta": SHAPE["rope_theta"]},
                          hidden_act="relu2", tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                          pad_token_id=0)
    quant = BitNetQuantConfig(linear_class="autobitlinear", quantization_mode="offline",
                              modules_to_not_convert=["lm_head"])
    torch.manual_seed(SEED)
    model = BitNetForCausalLM(config)
    replace_with_bitnet_linear(model, modules_to_not_convert=["lm_head"], quantization_config=quant)
    model.to_empty(device="cpu")   # the replaced layers were made on the meta device: draw every weight anew
    generator = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if name.endswith("weight_scale"):
                tensor.copy_(0.05 + 0.05 * torch.rand(tensor.shape, generator=generator))
            elif "norm" in name:
                tensor.copy_(1 + 0.1 * torch.randn(tensor.shape, generator=generator))
            elif name.endswith(".weight") and "proj" in name:
                tensor.copy_(torch.randint(-1, 2, tensor.shape, generator=generator).float())
            elif name.endswith(".weight"):
                tensor.copy_(INIT_RANGE * torch.randn(tensor.shape, generator=generator))
    model.model.rotary_emb.inv_freq = model.model.rotary_emb.compute_default_rope_parameters(model.config)[0]
    return model.eval().requires_grad_(False)


@main.command("torch")
@click.argument("ckpt", type=click.Path(exists=True, file_okay=False))
def torch_onnx(ckpt):
    """torch.onnx.export(dynamo=True) of the Llama from CKPT and of a BitNet with offline AutoBitLinear."""
    from transformers import LlamaForCausalLM
    llama = LlamaForCausalLM.from_pretrained(ckpt).eval()
    _torch_export(llama, llama.config, _fresh("torch_llama"))
    bitnet = _bitnet(ckpt)
    _torch_export(bitnet, bitnet.config, _fresh("torch_bitnet"))


if __name__ == "__main__":
    main()
