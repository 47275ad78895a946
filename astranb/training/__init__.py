"""Trainers: `local.LocalTrainer` (this process) and the FSDP2 backend behind a trainer service
(`fsdp`, over the pickle-free command channel in `collective`). Both satisfy
`astranb.contracts.Trainer`."""
