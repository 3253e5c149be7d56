"""The store inside the trainers people launch: one module per framework, each importing its
framework only when it is used.

* :mod:`infinity.integrations.hf`: Hugging Face ``Trainer`` (``InfinityTrainer``, and
  ``with_store`` for its subclasses such as TRL's ``SFTTrainer``);
* :mod:`infinity.integrations.accelerate`: ``InfinityAccelerator`` for ``accelerate`` loops;
* :mod:`infinity.integrations.lightning`: ``InfinityStrategy`` for PyTorch Lightning.

Each keeps its framework from wrapping the attached model in ``DistributedDataParallel`` or
moving it (the store places the parameters and averages gradients across ranks), leaves
gradient clipping and the logged gradient norm to the framework (``clip_grad_norm_`` over an
attached model's parameters gives the global norm before clipping), and routes checkpoints
through ``store.save_checkpoint`` / ``load_checkpoint`` on every rank: the model is never
gathered whole into one process and its state is never pickled.
"""
