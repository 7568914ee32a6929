"""Training: Lightning module and data module, schedules, callbacks, loggers, the ``run`` entry point."""
