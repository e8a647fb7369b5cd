"""Every family on tiny random-initialised Hugging Face model classes, one epoch with
validation: a crash hunt (thirty-first stop, ``benchmarks/results/session31.md``).

    OMP_NUM_THREADS=1 python benchmarks/hf_classes.py gpt2,distilbert,hf_vit,hf_resnet

Each model is first trained here for 150 steps on generated data (tokens whose first
position carries the label; images whose first channel is shifted by it), then bayesified
with every family's defaults. One line per family: ``OK`` with the evaluation, or ``ERR``
with the exception; ``START`` gives the network's own validation accuracy, and a family
more than 2 points below it is flagged ``LOW`` (another network computed, not a crash).
"""

from __future__ import annotations

import sys
import time
import warnings

import torch
import transformers as T
from torch.utils.data import DataLoader, Dataset

import bayesify
from bayesify.kit import laplace_heads

warnings.simplefilter("ignore")
T.logging.set_verbosity_error()

class TokDS(Dataset):
    def __init__(self, n, seed, vocab=100, L=12, pad=0):
        g = torch.Generator().manual_seed(seed)
        self.y = torch.randint(0, 3, (n,), generator=g)
        self.ids = torch.randint(5, vocab, (n, L), generator=g)
        self.ids[:, 0] = self.y + 1  # the label token
        lens = torch.randint(6, L + 1, (n,), generator=g)
        self.mask = (torch.arange(L)[None] < lens[:, None]).long()
        self.ids = torch.where(self.mask.bool(), self.ids, torch.full_like(self.ids, pad))
    def __len__(self): return len(self.y)
    def __getitem__(self, i): return {"input_ids": self.ids[i], "attention_mask": self.mask[i], "labels": self.y[i]}

class EosDS(TokDS):
    """TokDS with one <eos> (id 4) closing every sequence (BART pools its state)."""
    def __init__(self, n, seed):
        super().__init__(n, seed)
        last = self.mask.sum(1) - 1
        self.ids[torch.arange(len(self.ids)), last] = 4

class ImgDS(Dataset):
    def __init__(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        self.y = torch.randint(0, 3, (n,), generator=g)
        self.x = torch.randn(n, 3, 32, 32, generator=g) * 0.5
        self.x[:, 0] += self.y[:, None, None].float()
    def __len__(self): return len(self.y)
    def __getitem__(self, i): return {"pixel_values": self.x[i], "labels": self.y[i]}

class AudioDS(Dataset):
    """Raw waveforms (``input_values`` [samples]) whose tone's frequency carries the label,
    padded to one length with an ``attention_mask`` (Wav2Vec2-style audio classifiers)."""
    def __init__(self, n, seed, length=800):
        g = torch.Generator().manual_seed(seed)
        self.y = torch.randint(0, 3, (n,), generator=g)
        t = torch.arange(length) / 1600.0
        lens = torch.randint(length // 2, length + 1, (n,), generator=g)
        self.mask = (torch.arange(length)[None] < lens[:, None]).long()
        tone = torch.sin(2 * torch.pi * (100.0 + 150.0 * self.y[:, None].float()) * t[None])
        self.x = (tone + 0.3 * torch.randn(n, length, generator=g)) * self.mask
    def __len__(self): return len(self.y)
    def __getitem__(self, i):
        return {"input_values": self.x[i], "attention_mask": self.mask[i], "labels": self.y[i]}

class MelDS(Dataset):
    """Log-mel-like spectrograms whose band carries the label: ``input_features`` [mels,
    frames] (Whisper) or, with ``key="input_values"``, [frames, mels] (AST)."""
    key, mels, frames = "input_features", 16, 32
    def __init__(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        self.y = torch.randint(0, 3, (n,), generator=g)
        self.x = 0.5 * torch.randn(n, self.mels, self.frames, generator=g)
        for k in range(3):
            self.x[self.y == k, 4 * k:4 * k + 4] += 1.5
    def __len__(self): return len(self.y)
    def __getitem__(self, i):
        x = self.x[i] if self.key == "input_features" else self.x[i].T.contiguous()
        return {self.key: x, "labels": self.y[i]}

class SpecDS(MelDS):
    key = "input_values"

def pretrain(model, ds, steps=150):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model.train()
    dl = DataLoader(ds, batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(0))
    it = iter(dl)
    for _ in range(steps):
        try: b = next(it)
        except StopIteration: it = iter(dl); b = next(it)
        labels = b.pop("labels")  # DeiT's teacher class takes no labels
        loss = torch.nn.functional.cross_entropy(model(**b).logits, labels)
        opt.zero_grad(); loss.backward(); opt.step()
    model.eval(); return model

def build(name):
    torch.manual_seed(0)
    if name == "gpt2":
        cfg = T.GPT2Config(vocab_size=100, n_positions=16, n_embd=32, n_layer=2, n_head=2, num_labels=3, pad_token_id=0)
        return T.GPT2ForSequenceClassification(cfg), TokDS
    if name == "distilbert":
        cfg = T.DistilBertConfig(vocab_size=100, max_position_embeddings=16, dim=32, n_layers=2, n_heads=2, hidden_dim=64, num_labels=3)
        return T.DistilBertForSequenceClassification(cfg), TokDS
    if name == "hf_vit":
        cfg = T.ViTConfig(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, num_labels=3)
        return T.ViTForImageClassification(cfg), ImgDS
    if name == "hf_resnet":
        cfg = T.ResNetConfig(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], num_labels=3)
        return T.ResNetForImageClassification(cfg), ImgDS
    # thirty-third stop: classes whose heads or layers differ from the four above
    text = {"vocab_size": 100, "hidden_size": 32, "num_hidden_layers": 2,
            "num_attention_heads": 2, "intermediate_size": 64, "max_position_embeddings": 32,
            "num_labels": 3}
    if name == "bert":  # pooler (tanh) + dropout + Linear
        return T.BertForSequenceClassification(T.BertConfig(**text)), TokDS
    if name == "roberta":  # a two-layer head (dense, tanh, out_proj) on the first token
        return T.RobertaForSequenceClassification(T.RobertaConfig(**text, pad_token_id=1)), TokDS
    if name == "albert":  # one layer's weights shared by every layer
        return T.AlbertForSequenceClassification(T.AlbertConfig(**text, embedding_size=16)), TokDS
    if name == "deberta_v2":  # relative attention, ContextPooler, StableDropout
        return T.DebertaV2ForSequenceClassification(T.DebertaV2Config(**text)), TokDS
    if name == "hf_convnext":  # LayerNorm on channels, layer scale, a LayerNorm before the head
        cfg = T.ConvNextConfig(num_channels=3, num_stages=2, hidden_sizes=[16, 32], depths=[1, 1],
                               num_labels=3, image_size=32)
        return T.ConvNextForImageClassification(cfg), ImgDS
    if name == "hf_swin":  # shifted windows
        cfg = T.SwinConfig(image_size=32, patch_size=4, embed_dim=16, depths=[1, 1],
                           num_heads=[2, 2], window_size=4, num_labels=3)
        return T.SwinForImageClassification(cfg), ImgDS
    if name == "hf_deit_distilled":  # two classifiers (class and distillation token) averaged
        cfg = T.DeiTConfig(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2,
                           num_attention_heads=2, intermediate_size=64, num_labels=3)
        return T.DeiTForImageClassificationWithTeacher(cfg), ImgDS
    # thirty-fifth stop: more heads and poolings
    if name == "llama":  # a decoder: `score` at every token, the last non-padding one gathered
        cfg = T.LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64,
                            num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                            max_position_embeddings=32, num_labels=3, pad_token_id=0)
        return T.LlamaForSequenceClassification(cfg), TokDS
    if name == "bart":  # encoder-decoder; the <eos> token's state into a dense-tanh-Linear head
        cfg = T.BartConfig(vocab_size=100, d_model=32, encoder_layers=1, decoder_layers=1,
                           encoder_attention_heads=2, decoder_attention_heads=2,
                           encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=32,
                           num_labels=3, pad_token_id=0, eos_token_id=4, bos_token_id=4)
        return T.BartForSequenceClassification(cfg), EosDS
    if name == "electra":  # a dense-GELU-Linear head on the first token
        return T.ElectraForSequenceClassification(T.ElectraConfig(**text, embedding_size=16)), TokDS
    if name == "mobilebert":  # bottlenecks, NoNorm (an elementwise affine, not a normalisation)
        cfg = T.MobileBertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2,
                                 num_attention_heads=2, intermediate_size=64, embedding_size=16,
                                 intra_bottleneck_size=16, max_position_embeddings=32,
                                 num_labels=3, true_hidden_size=16)
        return T.MobileBertForSequenceClassification(cfg), TokDS
    if name == "hf_levit_distilled":  # two heads (BatchNorm1d + Linear each) averaged
        cfg = T.LevitConfig(image_size=32, patch_size=16, hidden_sizes=[32, 48], num_attention_heads=[2, 2],
                            depths=[1, 1], key_dim=[8, 8], drop_path_rate=0, mlp_ratio=[2, 2],
                            attention_ratio=[2, 2], num_labels=3, down_ops=[["Subsample", 8, 2, 2, 2, 2]])
        return T.LevitForImageClassificationWithTeacher(cfg), ImgDS
    if name == "hf_mobilevit":  # convolutions and transformer blocks, a 1x1 conv before the head
        cfg = T.MobileViTConfig(image_size=32, patch_size=2, hidden_sizes=[16, 24, 32],
                                neck_hidden_sizes=[8, 8, 16, 16, 24, 24, 48], num_labels=3)
        return T.MobileViTForImageClassification(cfg), ImgDS
    if name == "hf_dinov2":  # the class token concatenated with the mean patch token
        cfg = T.Dinov2Config(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2,
                             num_attention_heads=2, mlp_ratio=2, num_labels=3)
        return T.Dinov2ForImageClassification(cfg), ImgDS
    if name == "hf_mobilenet_v2":  # depthwise convolutions, ReLU6, TF padding
        cfg = T.MobileNetV2Config(image_size=32, depth_multiplier=0.35, num_labels=3)
        return T.MobileNetV2ForImageClassification(cfg), ImgDS
    if name == "hf_beit":  # relative position bias, layer scale, mean pooling
        cfg = T.BeitConfig(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2,
                           num_attention_heads=2, intermediate_size=64, num_labels=3,
                           use_mean_pooling=True)
        return T.BeitForImageClassification(cfg), ImgDS
    # thirty-sixth stop: audio, weight-standardised convolutions, GRN, more poolings
    if name == "wav2vec2":  # raw audio, a convolutional feature encoder, masked mean pooling
        cfg = T.Wav2Vec2Config(vocab_size=32, hidden_size=32, num_hidden_layers=2,
                               num_attention_heads=2, intermediate_size=64, conv_dim=(16, 16),
                               conv_stride=(5, 4), conv_kernel=(10, 8), num_conv_pos_embeddings=8,
                               num_conv_pos_embedding_groups=2, classifier_proj_size=16,
                               num_labels=3, feat_extract_norm="layer", do_stable_layer_norm=True)
        return T.Wav2Vec2ForSequenceClassification(cfg), AudioDS
    if name == "hf_convnextv2":  # global response normalisation
        cfg = T.ConvNextV2Config(num_channels=3, num_stages=2, hidden_sizes=[16, 32],
                                 depths=[1, 1], num_labels=3, image_size=32)
        return T.ConvNextV2ForImageClassification(cfg), ImgDS
    if name == "hf_swinv2":  # cosine attention, log-spaced continuous position bias
        cfg = T.Swinv2Config(image_size=32, patch_size=4, embed_dim=16, depths=[1, 1],
                             num_heads=[2, 2], window_size=4, num_labels=3)
        return T.Swinv2ForImageClassification(cfg), ImgDS
    if name == "hf_segformer":  # efficient attention with spatial reduction, mean pooling
        cfg = T.SegformerConfig(num_channels=3, num_encoder_blocks=2, depths=[1, 1],
                                sr_ratios=[2, 1], hidden_sizes=[16, 32], patch_sizes=[7, 3],
                                strides=[4, 2], num_attention_heads=[1, 2], mlp_ratios=[2, 2],
                                num_labels=3)
        return T.SegformerForImageClassification(cfg), ImgDS
    if name == "hf_regnet":  # grouped convolutions, squeeze-excitation
        cfg = T.RegNetConfig(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1],
                             groups_width=8, num_labels=3)
        return T.RegNetForImageClassification(cfg), ImgDS
    if name == "hf_bit":  # weight-standardised convolutions, GroupNorm
        cfg = T.BitConfig(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], num_groups=4,
                          num_labels=3)
        return T.BitForImageClassification(cfg), ImgDS
    if name == "xlnet":  # the last token's summary (relative attention, memory)
        cfg = T.XLNetConfig(vocab_size=100, d_model=32, n_layer=2, n_head=2, d_inner=64,
                            num_labels=3, pad_token_id=0)
        return T.XLNetForSequenceClassification(cfg), TokDS
    if name == "t5":  # encoder-decoder, RMS LayerNorm, the <eos> state into a head
        cfg = T.T5Config(vocab_size=100, d_model=32, d_kv=16, d_ff=64, num_layers=1,
                         num_decoder_layers=1, num_heads=2, num_labels=3, pad_token_id=0,
                         eos_token_id=4, decoder_start_token_id=0)
        return T.T5ForSequenceClassification(cfg), EosDS
    if name == "hf_clip":  # CLIP's vision tower, mean-pooled patches into a Linear head
        cfg = T.CLIPConfig(vision_config={"image_size": 32, "patch_size": 8, "hidden_size": 32,
                                          "num_hidden_layers": 2, "num_attention_heads": 2,
                                          "intermediate_size": 64},
                           text_config={"vocab_size": 100, "hidden_size": 32,
                                        "num_hidden_layers": 1, "num_attention_heads": 2,
                                        "intermediate_size": 64}, num_labels=3)
        return T.CLIPForImageClassification(cfg), ImgDS
    # thirty-eighth stop: convolutional/Fourier/pooled-token text encoders, audio spectrograms,
    # more vision backbones
    if name == "squeezebert":  # grouped 1-D convolutions on [B, C, L] in attention and FFN
        cfg = T.SqueezeBertConfig(**text, embedding_size=32, q_groups=2, k_groups=2, v_groups=2,
                                  post_attention_groups=2, intermediate_groups=2, output_groups=2)
        return T.SqueezeBertForSequenceClassification(cfg), TokDS
    if name == "fnet":  # Fourier token mixing (no attention)
        cfg = T.FNetConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2,
                           intermediate_size=64, max_position_embeddings=32, num_labels=3)
        return T.FNetForSequenceClassification(cfg), TokDS
    if name == "funnel":  # token pooling between blocks
        cfg = T.FunnelConfig(vocab_size=100, block_sizes=[1, 1], d_model=32, n_head=2, d_head=16,
                             d_inner=64, num_decoder_layers=1, num_labels=3)
        return T.FunnelForSequenceClassification(cfg), TokDS
    if name == "convbert":  # span-based dynamic convolution beside attention
        cfg = T.ConvBertConfig(**text, embedding_size=32, head_ratio=2, conv_kernel_size=3)
        return T.ConvBertForSequenceClassification(cfg), TokDS
    if name == "modernbert":  # rotary, GeGLU, unpadded tokens, mean or CLS pooling head
        cfg = T.ModernBertConfig(vocab_size=100, hidden_size=32, intermediate_size=64,
                                 num_hidden_layers=2, num_attention_heads=2,
                                 max_position_embeddings=32, num_labels=3, pad_token_id=0,
                                 global_attn_every_n_layers=1, classifier_pooling="mean")
        return T.ModernBertForSequenceClassification(cfg), TokDS
    if name == "qwen2":  # decoder with grouped keys/values, biases on q/k/v only
        cfg = T.Qwen2Config(vocab_size=100, hidden_size=32, intermediate_size=64,
                            num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                            max_position_embeddings=32, num_labels=3, pad_token_id=0)
        return T.Qwen2ForSequenceClassification(cfg), TokDS
    if name == "ibert":  # integer-only quantisation modules (quant_mode off: float)
        return T.IBertForSequenceClassification(T.IBertConfig(**text, pad_token_id=1)), TokDS
    if name == "esm":  # rotary protein encoder, a dense-tanh head
        cfg = T.EsmConfig(**text, pad_token_id=0, position_embedding_type="rotary",
                          mask_token_id=3)
        return T.EsmForSequenceClassification(cfg), TokDS
    if name == "canine":  # characters hashed into embeddings, strided downsampling conv
        cfg = T.CanineConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                             intermediate_size=64, max_position_embeddings=64,
                             num_hash_functions=2, num_hash_buckets=64, downsampling_rate=2,
                             upsampling_kernel_size=2, local_transformer_stride=4, num_labels=3)
        return T.CanineForSequenceClassification(cfg), TokDS
    if name == "longformer":  # sliding-window + global attention
        cfg = T.LongformerConfig(**text, attention_window=4, pad_token_id=1)
        return T.LongformerForSequenceClassification(cfg), TokDS
    if name == "whisper":  # log-mel encoder, two 1-D convolutions, mean-pooled projector
        cfg = T.WhisperConfig(vocab_size=100, num_mel_bins=16, d_model=32, encoder_layers=2,
                              encoder_attention_heads=2, decoder_layers=1,
                              decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64,
                              max_source_positions=16, classifier_proj_size=16, num_labels=3)
        return T.WhisperForAudioClassification(cfg), MelDS
    if name == "ast":  # audio spectrogram transformer: patches of a spectrogram, two tokens
        cfg = T.ASTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                          intermediate_size=64, patch_size=8, frequency_stride=8, time_stride=8,
                          max_length=32, num_mel_bins=16, num_labels=3)
        return T.ASTForAudioClassification(cfg), SpecDS
    if name == "wavlm":  # gated relative position bias
        cfg = T.WavLMConfig(vocab_size=32, hidden_size=32, num_hidden_layers=2,
                            num_attention_heads=2, intermediate_size=64, conv_dim=(16, 16),
                            conv_stride=(5, 4), conv_kernel=(10, 8), num_conv_pos_embeddings=8,
                            num_conv_pos_embedding_groups=2, classifier_proj_size=16,
                            num_labels=3, num_buckets=16, max_bucket_distance=32)
        return T.WavLMForSequenceClassification(cfg), AudioDS
    if name == "deberta":  # DeBERTa v1: the attention computes with self.in_proj.weight
        return T.DebertaForSequenceClassification(T.DebertaConfig(**text)), TokDS
    if name == "bloom":  # ALiBi decoder; dense layers read directly when pretraining_tp > 1
        cfg = T.BloomConfig(vocab_size=100, hidden_size=32, n_layer=2, n_head=2, num_labels=3,
                            pad_token_id=0)
        return T.BloomForSequenceClassification(cfg), TokDS
    if name == "falcon":  # FalconLinear: a Linear subclass with its own forward (x @ Wᵀ)
        cfg = T.FalconConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2,
                             num_attention_heads=2, num_labels=3, pad_token_id=0, bias=True)
        return T.FalconForSequenceClassification(cfg), TokDS
    if name == "hf_efficientnet":  # depthwise, squeeze-excitation, TF "same" padding
        cfg = T.EfficientNetConfig(image_size=32, width_coefficient=0.25, depth_coefficient=0.25,
                                   hidden_dim=320, num_labels=3)
        return T.EfficientNetForImageClassification(cfg), ImgDS
    if name == "hiera":  # mask-unit attention, unrolled tokens
        cfg = T.HieraConfig(image_size=[32, 32], patch_size=[3, 3], patch_stride=[2, 2],
                            patch_padding=[1, 1], embed_dim=16, depths=[1, 1], num_heads=[1, 2],
                            query_stride=[2, 2], masked_unit_size=[4, 4], num_query_pool=1,
                            masked_unit_attention=[True, False], num_labels=3)
        return T.HieraForImageClassification(cfg), ImgDS
    if name == "hf_focalnet":  # focal modulation instead of attention
        cfg = T.FocalNetConfig(image_size=32, patch_size=4, embed_dim=16, depths=[1, 1],
                               focal_levels=[2, 2], focal_windows=[3, 3], num_labels=3)
        return T.FocalNetForImageClassification(cfg), ImgDS
    if name == "hf_poolformer":  # average pooling as token mixer, GroupNorm
        cfg = T.PoolFormerConfig(num_channels=3, num_encoder_blocks=2, depths=[1, 1],
                                 hidden_sizes=[16, 32], patch_sizes=[7, 3], strides=[4, 2],
                                 padding=[2, 1], num_labels=3)
        return T.PoolFormerForImageClassification(cfg), ImgDS
    if name == "hf_cvt":  # convolutional projections of q/k/v, a cls token in the last stage
        # (depth[s] > s: modeling_cvt indexes its drop-path rates by the stage)
        cfg = T.CvtConfig(num_channels=3, patch_sizes=[7, 3, 3], patch_stride=[4, 2, 1],
                          patch_padding=[2, 1, 1], embed_dim=[16, 16, 32], num_heads=[1, 1, 2],
                          depth=[1, 2, 3], mlp_ratio=[2.0, 2.0, 2.0],
                          attention_drop_rate=[0.0, 0.0, 0.0], drop_rate=[0.0, 0.0, 0.0],
                          drop_path_rate=[0.0, 0.0, 0.1], qkv_bias=[True, True, True],
                          cls_token=[False, False, True], qkv_projection_method=["dw_bn"] * 3,
                          kernel_qkv=[3, 3, 3], padding_kv=[1, 1, 1], stride_kv=[2, 2, 2],
                          padding_q=[1, 1, 1], stride_q=[1, 1, 1], num_labels=3)
        return T.CvtForImageClassification(cfg), ImgDS
    if name == "hf_swiftformer":  # efficient additive attention, BatchNorm
        cfg = T.SwiftFormerConfig(image_size=32, depths=[1, 1, 1, 1],
                                  embed_dims=[16, 16, 32, 32], num_labels=3)
        return T.SwiftFormerForImageClassification(cfg), ImgDS
    if name == "hf_data2vec_vision":  # BEiT-style, shared relative position bias
        cfg = T.Data2VecVisionConfig(image_size=32, patch_size=8, hidden_size=32,
                                     num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, num_labels=3,
                                     use_shared_relative_position_bias=True, use_mean_pooling=True)
        return T.Data2VecVisionForImageClassification(cfg), ImgDS

@torch.no_grad()
def _accuracy(bnn, loader) -> float:
    right = total = 0
    for batch in loader:
        labels = batch.pop("labels")
        probs = bnn.predictor()(batch).probs
        right += int((probs.argmax(-1) == labels).sum())
        total += len(labels)
    return right / total


@torch.no_grad()
def _start_accuracy(model, loader) -> float:
    model.eval()
    right = total = 0
    for batch in loader:
        batch = dict(batch)
        labels = batch.pop("labels")
        right += int((model(**batch).logits.argmax(-1) == labels).sum())
        total += len(labels)
    return right / total


def main() -> None:
    for name in sys.argv[1].split(","):
        model, data = build(name)
        model = pretrain(model, data(200, 0))
        train = DataLoader(data(200, 0), batch_size=16)
        val = DataLoader(data(120, 1), batch_size=40)
        start = _start_accuracy(model, val)
        print("START", name, f"val accuracy {start:.3f}", flush=True)
        for family in bayesify.list_methods():
            began = time.time()
            try:
                bnn = bayesify.bayesify(model, family)
                bayesify.fit(bnn, train, val_loader=val, epochs=1, progress=False)
                heads = (" heads" if laplace_heads.fitted(bnn) else " no heads"
                         if laplace_heads.enabled(bnn) or family != "laplace" else "")
                accuracy = _accuracy(bnn, val)
                # a family far below the network it wraps computes another network (the
                # thirty-seventh stop found BiT's weight-standardised convolutions this way)
                low = "  LOW: more than 2 points below the start" if accuracy < start - 0.02 else ""
                print("OK ", name, family, f"val accuracy {accuracy:.3f}",
                      f"{time.time() - began:.1f} s{heads}{low}", flush=True)
            except Exception as err:  # noqa: BLE001 - a line says what failed
                print("ERR", name, family, type(err).__name__,
                      str(err)[:300].replace("\n", " "), flush=True)


if __name__ == "__main__":
    main()
