"""`/v1/live/sessions`: OpenAI's GPT-Live, with client and Responses delegation."""
