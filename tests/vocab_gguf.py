"""Test helper: vocab-only GGUF files (arch qwen35, Qwen3.5-0.8B hparams) that llama.cpp can load.

write_vocab_gguf(path, vocab) writes the tokenizer.* keys of vocab_metadata(vocab) plus the qwen35
hyper-parameters of Qwen3.5-0.8B (spec §3.2, no MTP) so that llama.cpp's hparam loading passes too.
read_tokenizer_metadata(path) reads the tokenizer.* keys back as plain Python values.
"""
from __future__ import annotations

import struct
from pathlib import Path

import gguf

from legacy_engine.format.vocab import Vocab, vocab_metadata

ARCH = "qwen35"


def write_vocab_gguf(path: str | Path, vocab: Vocab) -> Path:
    path = Path(path)
    w = gguf.GGUFWriter(str(path), ARCH)
    # Qwen3.5-0.8B text config (spec §1.2 / §3.2), converted with --no-mtp
    w.add_block_count(24)
    w.add_context_length(262144)
    w.add_embedding_length(1024)
    w.add_feed_forward_length(3584)
    w.add_head_count(8)
    w.add_head_count_kv(2)
    w.add_key_length(256)
    w.add_value_length(256)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1e7)
    w.add_rope_dimension_count(64)
    w.add_rope_dimension_sections([11, 11, 10, 0])
    w.add_ssm_conv_kernel(4)
    w.add_ssm_state_size(128)
    w.add_ssm_group_count(16)
    w.add_ssm_time_step_rank(16)
    w.add_ssm_inner_size(2048)
    w.add_full_attention_interval(4)
    w.add_file_type(0)

    m = vocab_metadata(vocab)
    w.add_tokenizer_model(m["tokenizer.ggml.model"])
    w.add_tokenizer_pre(m["tokenizer.ggml.pre"])
    w.add_token_list(m["tokenizer.ggml.tokens"])
    w.add_token_types(m["tokenizer.ggml.token_type"])
    w.add_token_merges(m["tokenizer.ggml.merges"])
    w.add_eos_token_id(m["tokenizer.ggml.eos_token_id"])
    w.add_pad_token_id(m["tokenizer.ggml.padding_token_id"])
    w.add_bos_token_id(m["tokenizer.ggml.bos_token_id"])
    w.add_add_bos_token(m["tokenizer.ggml.add_bos_token"])
    w.add_chat_template(m["tokenizer.chat_template"])

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def read_tokenizer_metadata(path: str | Path) -> dict[str, object]:
    """tokenizer.* key/values of a GGUF file as Python values (lists of str / int, int, bool, str).

    A minimal KV reader (spec §3.1): gguf.GGUFReader takes ~20 s on a 248k-token vocabulary.
    """
    data = Path(path).read_bytes()
    scalar = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
    pos = 0

    def take(fmt: str):
        nonlocal pos
        v = struct.unpack_from(fmt, data, pos)[0]
        pos += struct.calcsize(fmt)
        return v

    def string() -> str:
        nonlocal pos
        n = take("<Q")
        pos += n
        return data[pos - n:pos].decode("utf-8")

    def value(t: int):
        if t == 8:
            return string()
        if t == 9:
            et, n = take("<I"), take("<Q")
            return [value(et) for _ in range(n)]
        return take(scalar[t])

    if data[:4] != b"GGUF" or struct.unpack_from("<I", data, 4)[0] != 3:
        raise ValueError(f"{path} is not a GGUF v3 file")
    pos = 8
    _n_tensors, n_kv = take("<Q"), take("<Q")
    out: dict[str, object] = {}
    for _ in range(n_kv):
        key = string()
        v = value(take("<I"))
        if key.startswith("tokenizer."):
            out[key] = v
    return out
