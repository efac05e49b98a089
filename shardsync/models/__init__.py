"""Reference models: a TP engine decoder and a Megatron-layout TP/PP trainer, in plain PyTorch."""
