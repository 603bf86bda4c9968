"""The trainer's configuration: its keys (`keys`), their reading and checks (`resolve`), and the keys of other
trainers' configs (LLaMA-Factory, ms-swift) mapped onto them (`foreign_configs`)."""
