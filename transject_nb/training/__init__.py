"Training: data, batches, the learner, configs, checkpoints, the fastai fixes, the language models and the CLI."
