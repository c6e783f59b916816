"""What one framework does differently, each switched on by a framework profile field (conf/framework):
``deepspeed_zero3`` (DeepSpeed 2021's ZeRO-3 tensor by tensor), ``owner_reduce`` and ``zero12_step``
(DeepSpeed's ZeRO-1/2 reduction and fp32 gradient partition), ``dp_chunks`` (Megatron-Core's per-chunk
overlap), ``fp8_params`` (FP8 parameter all-gather), ``fp8_weights`` (Transformer Engine's FP8 copies),
``bf16_optimizer`` (DeepSpeed BF16_Optimizer's gradient casts)."""
