"""Fixed test prompts of different lengths.

Lengths (in tokens of the test tokenizer, bos included) are chosen so that a
batch mixes very short prompts with ones that sit just below a 64- or 128-token
KV-cache block boundary, which generation then crosses, and one long prompt
that spans several blocks and needs chunked prefill with small token budgets.
``test_testing_models.py`` checks the ranges, so editing a prompt that breaks
one fails loudly rather than silently weakening the tests that rely on it.
"""

from __future__ import annotations

#: Ten prompts. Their token counts (test tokenizer, bos included) are 5, 6, 30,
#: 26, 58, 61, 73, 118, 77 and 354.
TEST_PROMPTS: tuple[str, ...] = (
    "Hello",
    "The capital of France is",
    "Once upon a time, in a small village by the sea, there lived",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))",
    "Question: How many legs does a spider have? Answer: A spider has eight legs. "
    "Question: How many wheels does a bicycle have? Answer:",
    # Just under one 64-token block: generation crosses the boundary.
    "The old lighthouse stood at the edge of the cliff for a hundred years. Every night "
    "the keeper climbed the stairs and watched the ships pass, and every morning he wrote",
    "Numbers and dates: 3, 14, 159, 2653, 58979 and then 2024-05-17 at 12:30, "
    "followed by 1,250 apples, 37 pears and 8 melons. Add 7 to 21 and divide by 4:",
    # Just under two 64-token blocks (one 128-token block).
    "In the kitchen the recipe called for flour, salt, eggs and a little warm milk. "
    "The cook mixed the dry ingredients first, then added the eggs one at a time and "
    "stirred slowly until the batter was smooth. While it rested, she heated the pan. "
    "When the first pancake came out burnt, everybody laughed and said that the first "
    "one is always",
    "Write a short story about a robot who learns to paint. The robot lives in a "
    "quiet town near a forest and works at the train station, where it sweeps the "
    "platforms and sells tickets.",
    # Several blocks long: exercises multi-block prefill and chunked prefill.
    "History is not a straight road. Cities rise near rivers, trade follows the water, "
    "and languages borrow words from their neighbours. The old harbour town was built "
    "on salt and fish, then on wool, and finally on ships. Its library kept maps drawn "
    "by sailors who had never seen the coasts they described, and letters from "
    "merchants who complained about the weather, the taxes, and the price of pepper. "
    "In spring the committee met to discuss a new park: some members wanted trees and "
    "benches, others a playground, a pond and a path for bicycles. After a long debate "
    "they agreed on a plan, a budget and a date. My grandmother kept bees behind the "
    "garden wall and sold jars of honey at the market every autumn; every winter she "
    "gave the last jars away to her friends, because the bees had worked hard all year. "
    "A good story needs a place, a person and a problem. The place can be a city, a "
    "forest, a ship or a single room, and the person wants something they cannot simply "
    "take. Tell me, in your own words, what all of these stories have in common:",
)
