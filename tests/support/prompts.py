"""Eight prompts of eight different lengths, shared by the real-model tests."""

PROMPTS = [
    "The capital of France is",
    "Write a short poem about the sea.",
    "def fibonacci(n):",
    "Explain in one paragraph why the sky is blue, as if talking to a curious ten-year-old child "
    "who keeps asking follow-up questions about light, air and colours.",
    "1, 2, 3, 4, 5,",
    "Translate to French: I would like a cup of coffee, please.",
    "List three facts about the Moon:",
    "Once upon a time, in a small village at the edge of a great forest, there lived an old "
    "clockmaker who had never once left his workshop. One winter morning, a stranger knocked on "
    "his door carrying a broken pocket watch and a map drawn on the back of a letter. The stranger said",
]
