"""The operator's decisions, a policy a module, each a pure function of a job's typed spec and
what one reconcile observed: its life (`life`), where it runs (`placement`), its GPUs' health
(`signal`), the generation document it publishes (`publish`) and its power (`power`);
`tessera_operator.desired` composes them into one `Desired`."""
