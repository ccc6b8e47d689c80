"""Prompts the engine tests share: a long story, chat questions behind a system prompt, a passage."""

from __future__ import annotations

STORY = "Write a long story about a dragon who learns to fly."  # greedy: 400 tokens and more


QUESTIONS = [
    "What is the capital of France?",
    "Write a poem about the ocean.",
    "Explain how photosynthesis works, step by step.",
    "Describe the history of the bicycle.",
    "What is Python?",
    "Write a letter to a friend about your summer holidays.",
    "Explain in detail how a steam engine works.",
    "Describe your ideal city in detail.",
]


SYSTEM = (
    "You are the assistant of a railway company. You answer questions about timetables, tickets, seat "
    "reservations, luggage, bicycles, pets, accessibility, delays and refunds. Keep every answer short and "
    "friendly. Never invent a train, a platform or a price: when you do not know, say so and point the traveller "
    "to the help desk in the main hall, open from six in the morning to ten at night. Refunds for delays of more "
    "than one hour are a quarter of the fare, and half of it from two hours."
)


PASSAGE = (
    "The city of Paris is the capital of France. It lies on the river Seine, in the north of the country, and is "
    "known for its museums, its cafes and the Eiffel Tower, which was built for the world fair of 1889. Every year "
    "millions of visitors walk along its boulevards, climb the hill of Montmartre and cross its many bridges."
)
