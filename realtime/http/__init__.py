"""The plain HTTP doors: speech, transcriptions, images, models, metrics, and answers for unknown paths."""
