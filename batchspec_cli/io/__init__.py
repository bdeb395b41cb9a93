"""Reading a job's input: prompts files, Hugging Face datasets, OpenAI Batch files, prompts to token ids."""
