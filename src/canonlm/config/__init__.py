"""The Python side of ``conf/``: from a composed config, or a saved run directory, to the model config, task and
tokenizer.

``conf/`` is the YAML tree Hydra composes; this package is everything canonlm does with the composed result before a
model is trained, evaluated, exported or sampled, so training (:mod:`canonlm.train`), evaluation
(:mod:`canonlm.eval`), Hugging Face interop (:mod:`canonlm.hf`) and the commands all read a config the same way and
none of them imports another to do it. It sits above ``arch`` and ``data`` (whose builders it calls) and below
everything that runs a model (the README's "Layout" table; ``tests/test_layers.py`` enforces it).

* :mod:`canonlm.config.resolvers` -- the OmegaConf resolvers and in-memory ``canon`` options the tree needs
  (register them before Hydra composes).
* :mod:`canonlm.config.rules` -- the accepted values of the training keys, declared as one table
  (:data:`~canonlm.config.rules.TRAINING_RULES`) and checked by one loop; ``PRECISIONS``, ``STRATEGIES``.
* :mod:`canonlm.config.strict` -- the keys canonlm reads (any other is refused, with the closest one; ``callbacks``
  and ``logger`` are the extension points), the command line composed as Hydra composes it (Hydra's errors as one
  ConfigError), the output directories Hydra will create.
* :mod:`canonlm.config.build` -- :func:`~canonlm.config.build.build_configs`: (task, ``ModelConfig``) from a
  composed config.
* :mod:`canonlm.config.rundir` -- a saved run: :func:`~canonlm.config.rundir.resolve_run`,
  :func:`~canonlm.config.rundir.load_run_config`, :func:`~canonlm.config.rundir.task_config`,
  :func:`~canonlm.config.rundir.run_tokenizer`.

Importing this package imports nothing else (``train.py`` registers the resolvers before Hydra composes, without
paying for torch).
"""
