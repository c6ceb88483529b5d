"""The fixed text the test tokenizer is trained on.

Written for this project (not taken from any dataset or library file) so the
trained vocabulary is identical on every machine and Python version: a
tokenizer trained on, say, a stdlib module's source would change whenever that
file does. Changing this string changes every tiny test model's vocabulary, so
bump ``TOKENIZER_VERSION`` in ``tokenizer.py`` when you edit it.
"""

CORPUS = r"""
The morning train left the station a few minutes late, and most of the passengers
did not seem to mind. A woman by the window was reading a thick novel about a
lighthouse keeper; the man across the aisle had fallen asleep with his hat over
his eyes. Outside, the fields were still silver with frost, and a line of crows
sat along the fence as if they were waiting for someone to count them.

In the kitchen, the recipe called for two cups of flour, one teaspoon of salt,
three eggs, and a little warm milk. Mix the dry ingredients first, then add the
eggs one at a time. Stir slowly until the batter is smooth. Let it rest for
twenty minutes before you pour it into a hot pan. If the first pancake is a
disaster, do not worry: the first one is always for the cook.

History is not a straight road. Cities rise near rivers, trade follows the
water, and languages borrow words from their neighbours. The old harbour town
was built on salt and fish, then on wool, and finally on ships. Its library
kept maps drawn by sailors who had never seen the coasts they described, and
letters from merchants who complained about the weather, the taxes, and the
price of pepper.

Why is the sky blue? Sunlight contains every colour, but the short blue waves
are scattered by the molecules of the air far more than the long red ones. At
sunset the light travels through much more air, so most of the blue is lost
and the clouds glow orange and red. Water boils at 100 degrees Celsius at sea
level, but at lower temperatures on a high mountain, where the pressure is low.

"Can you help me find the museum?" asked the tourist.
"Of course. Walk straight ahead, turn left at the bakery, and cross the bridge.
It is the large white building with the green doors."
"Thank you so much! Is it open on Sundays?"
"Yes, from ten in the morning until six in the evening."

Question: What is the capital of France? Answer: The capital of France is Paris.
Question: How many days are in a week? Answer: There are seven days in a week.
Question: Who wrote the letter? Answer: Nobody knows; it was never signed.

Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 13 16 20 32 42 64 100 128 256 512 1024
2048 4096 3.14159 2.71828 1e-5 -7 +12 50% $19.99 12:30 2024-05-17 #3 v1.2.0
The total was 1,250 apples, 37 pears and 8 melons, shared between 4 families.
If x = 7 and y = 3, then x * y = 21, x + y = 10, x - y = 4 and x / y = 2.33.

def fibonacci(n: int) -> list[int]:
    # Return the first n Fibonacci numbers.
    values = [0, 1]
    while len(values) < n:
        values.append(values[-1] + values[-2])
    return values[:n]


class Counter:
    def __init__(self) -> None:
        self.count = 0

    def increment(self, step: int = 1) -> int:
        self.count += step
        return self.count


for i in range(10):
    if i % 2 == 0:
        print(f"{i} is even")
    else:
        print(f"{i} is odd")

{"name": "example", "version": 3, "tags": ["alpha", "beta"], "enabled": true}
SELECT id, name FROM users WHERE age > 30 ORDER BY name;
const total = items.reduce((sum, item) => sum + item.price, 0);

The committee met on Tuesday to discuss the new park. Some members wanted more
trees and benches; others asked for a playground, a small pond, and a path for
bicycles. After a long debate they agreed on a plan, a budget, and a date. The
work will begin in spring, when the ground is soft, and should be finished
before the summer holidays.

A good story needs a place, a person, and a problem. The place can be a city, a
forest, a ship, or a single room. The person wants something and cannot simply
take it. The problem grows, the person changes, and at the end we understand
something we did not understand at the beginning.

My grandmother kept bees behind the garden wall. Every autumn she sold jars of
honey at the market, and every winter she gave the last jars away to friends.
She said the bees worked hard all year, so the least she could do was share.

The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor
jugs. How vexingly quick daft zebras jump! Sphinx of black quartz, judge my vow.
"""
