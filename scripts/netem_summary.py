#!/usr/bin/env python3
"""Seeds of `cargo xtask netem` side by side: each rule's mean epoch on LINK, the same configuration's
unshaped epoch, their ratio per seed and its median, and test accuracy (mean and 95% interval, t).

usage: python3 scripts/netem_summary.py LINK SEED:DIR[,DIR...] [SEED:DIR...]

Each DIR is a netem `--out` directory (its results.md); several DIRs of one seed are merged (later runs of
other rules). Prints a markdown table.
"""
import math
import statistics
import sys


def rows(path):
    out = {}
    for line in open(path):
        if not line.startswith('| ') or line.startswith('| link') or line.startswith('|---'):
            continue
        c = [x.strip() for x in line.strip().strip('|').split('|')]
        out[(c[0], c[1])] = {'epoch': float(c[5]), 'acc': float(c[9].rstrip('%'))}
    return out


def interval(xs):
    t = {2: 12.706, 3: 4.303, 4: 3.182, 5: 2.776}
    return t[len(xs)] * statistics.stdev(xs) / math.sqrt(len(xs)) if len(xs) in t else float('nan')


def main(link, specs):
    seeds = {}
    for spec in specs:
        seed, dirs = spec.split(':', 1)
        merged = {}
        for d in dirs.split(','):
            merged.update(rows(f'{d}/results.md'))
        seeds[seed] = merged
    rules = []
    for d in seeds.values():
        rules += [r for (l, r) in d if l == link and r not in rules]
    print(f'| rule | seeds | epoch on {link} (s) | unshaped epoch (s) | ratio per seed | median ratio | test acc. % |')
    print('|---|---|---|---|---|---|---|')
    for r in rules:
        got = [(s, d[(link, r)], d.get(('unshaped', r))) for s, d in seeds.items() if (link, r) in d]
        eps = ' / '.join(f"{g['epoch']:.2f}" for _, g, _ in got)
        uns = ' / '.join(f"{u['epoch']:.2f}" for _, _, u in got if u) or '-'
        ratios = [g['epoch'] / u['epoch'] for _, g, u in got if u]
        per = ' / '.join(f'{x:.2f}x' for x in ratios) or '-'
        med = f'{statistics.median(ratios):.2f}x' if ratios else '-'
        accs = [g['acc'] for _, g, _ in got]
        acc = f'{statistics.mean(accs):.1f} ± {interval(accs):.1f}' if len(accs) > 1 else f'{accs[0]:.1f}'
        print(f"| {r} | {','.join(s for s, _, _ in got)} | {eps} | {uns} | {per} | {med} | {acc} |")


if __name__ == '__main__':
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2:])
