"""The training frameworks whose own loops the agent drives (`hf`: Hugging Face's `Trainer`). Each
integration is imported by name, so that nothing here imports a framework a job does not use."""
