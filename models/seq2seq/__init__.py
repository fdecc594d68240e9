"""The Qwen3 encoder-decoder family: a bidirectional Qwen3 encoder and a decoder with T5Gemma 2-style merged
self/cross attention (`model.py`), trained with UL2 (`jobs/encoder_ul2.py`)."""

from models.seq2seq.model import Qwen3EncoderDecoderConfig, Qwen3EncoderModel, Qwen3ForSeq2SeqLM, merged_attention_mask

__all__ = ["Qwen3EncoderDecoderConfig", "Qwen3EncoderModel", "Qwen3ForSeq2SeqLM", "merged_attention_mask"]
