"""The training-free context-extension study on pretrained models (`extrapolab align rope hf:PATH`)."""
