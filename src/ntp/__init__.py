"""Nonuniform tensor parallelism: plan (pure), model, parallel layers, gradient sync, optimizer."""
