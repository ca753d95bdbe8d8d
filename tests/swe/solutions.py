"""Reference fixes of the shipped tasks, as the shell command a scripted agent would run."""

from __future__ import annotations

SOLUTIONS = {
    "calc_divide_by_zero": """cat > calc/core.py <<'EOF'
def add(a, b):
    return a + b


def subtract(a, b):
    return a - b


def multiply(a, b):
    return a * b


def divide(a, b):
    if b == 0:
        raise ValueError("cannot divide by zero")
    return a / b
EOF""",
    "text_slugify": """cat > textkit/slug.py <<'EOF'
def slugify(title):
    return "-".join(title.lower().split())
EOF""",
    "stats_median": """cat > stats/central.py <<'EOF'
def mean(values):
    return sum(values) / len(values)


def median(values):
    s = sorted(values)
    n = len(s)
    if n % 2:
        return s[n // 2]
    return (s[n // 2 - 1] + s[n // 2]) / 2
EOF""",
    "inventory_remove": """python3 - <<'EOF'
import re
path = "shop/inventory.py"
src = open(path).read()
src = src.replace('''        self.items[name] = self.items.get(name, 0) - count
''', '''        have = self.items.get(name, 0)
        if count > have:
            raise ValueError(f"only {have} of {name} in stock")
        if have == count:
            del self.items[name]
        else:
            self.items[name] = have - count
''')
open(path, "w").write(src)
EOF""",
}
