"""Nonuniform tensor parallelism: model, parallel layers, gradient sync, optimizer, trainer."""
