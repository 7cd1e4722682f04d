#!/usr/bin/env python3
"""Writes tokenizer_expected.json: the ids that Hugging Face's own tokenizer (the Rust
`tokenizers` library, through its Python binding) gives for a test corpus, with each of the
synthetic tokenizers that `lathe-synth tokenizer` writes and a few variants of them.
tests/engine/tokenizer_test.cc regenerates the same tokenizers, checks their SHA-256
against the one recorded here, and expects Lathe's Tokenizer to give the same ids. For the
three flavors it also records the pre-tokens (byte-level form) that each one's
pre-tokenizer alone gives, which tests the regex scanners without the merges in the way.

Run once, when the generator, the corpus or the variants change (CI does not run it), with
the project's virtual environment (scripts/requirements.txt pins `tokenizers`), either
letting the script run lathe-synth:

  .venv/bin/python tests/engine/data/make_tokenizer_expected.py \\
      --lathe-synth build/bin/lathe-synth

or on tokenizer.json files written beforehand by
`build/bin/lathe-synth tokenizer --flavor F --out DIR` for F = gpt2, llama3, qwen2:

  .venv/bin/python tests/engine/data/make_tokenizer_expected.py \\
      --gpt2 DIR_GPT2/tokenizer.json --llama3 DIR_LLAMA3/tokenizer.json \\
      --qwen2 DIR_QWEN2/tokenizer.json

The synthetic files use neither `ignore_merges` nor merges written as pairs, so that older
`tokenizers` releases read them too; the C++ tests cover those with small hand-made
tokenizers.
"""

import argparse
import copy
import hashlib
import json
import os
import subprocess
import sys
import tempfile

import tokenizers
from tokenizers import Tokenizer

FLAVORS = ('gpt2', 'llama3', 'qwen2')

# Every line is encoded with and without the post-processor's special tokens.
CORPUS = [
    'Hello world',
    'The lathe turns the wood slowly, and the turner shapes it.',
    "DON'T stop; IT'S fine. WE'LL see, THEY'RE here, I'VE got it, YOU'D know, I'M in.",
    "don't won't can't isn't we're they've I'll she'd",
    "John's JOHN'S john'S x'S 'Re 'rE 'LL 'Ll 'D 'M",
    "'tis the 'season' with 'quotes' and ' alone, '' twice, x' after",
    "Long s: 'ſ 'ſt 'ſs; Kelvin: 'K",
    "'ſt 'ſ 'K 'Ŀl x\u0301y \u0301ab \u00a0\u00a0x 'ﬅ \u00a0\n\u00a0x \u3000\u3000y",
    'Numbers: 1 12 123 1234 12345 3.14159 1,000,000 2024-06-01 007 12345678901234567890',
    'Other digits: ٣٤٥ ४५६ ²³ ½ Ⅻ ①② 𝟏𝟐𝟑',
    "Le tour à bois tourne ; l'artisan façonne une pièce élégante.",
    'Über die Straße, größer, Mädchen. İstanbul ıi ΣΑΣ ǅungla ʰ',
    'Ελληνικά: Η γλώσσα είναι ζωντανή και αλλάζει.',
    'Русский текст: Мы учимся каждый день. Добрий вечір!',
    '中文：机器学习正在改变世界。今天天气很好，我们去公园散步吧。',
    '日本語のテキストと、ひらがな、カタカナ。東京は大きな都市です。',
    '한국어 문장입니다. 안녕하세요!',
    'العربية جميلة جدا، ونحن نتعلمها.',
    'עברית: שלום עולם.',
    'हिन्दी: नमस्ते दुनिया। ไทย: สวัสดีครับ',
    'Emoji 😀👍🏽 👩‍💻 👨‍👩‍👧‍👦 🏳️‍🌈 🇫🇷🇩🇪 ❤️ ✔︎ 🚀!',
    # NFC-sensitive: decomposed accents, Hangul jamo, a mark after a dotted letter.
    'cafe\u0301 vs café; A\u030Angstro\u0308m; man\u0303ana; \u1E9B\u0323; \u1100\u1161\u11A8',
    '\u0301starts with a mark, then a mark alone: \u0301 and x\u0301\u0301',
    'two  spaces   three    four     five',
    'tab\there\t\tdouble tab \t mixed',
    'line1\nline2\n\nline4\r\nwindows\r\n\r\nend\rcr',
    'trailing spaces   ',
    '   leading spaces',
    '\n\n\nleading newlines',
    ' \n \n mixed \t\n whitespace \n',
    'nbsp\u00A0here ideographic\u3000space thin\u2009space nel\u0085line ls\u2028ps\u2029 '
    'vt\u000Bff\u000C fs\u001Cgs\u001D',
    'zero\u200Bwidth\u200Cnon\u200Djoiner\uFEFFbom \uE000 \uFFFD',
    'for (int i = 0; i < n; ++i) { total += w[i] * x[i]; }',
    '{"text": "hello", "ids": [1, 2, 3], "ok": true}',
    'https://example.com/a?b=c&d=e user@example.org #tag @name',
    '!!! ??? ... --- === *** ###\n\n!!!\n?!\r\n',
    'abc123def 456ghi 12abc a1b2c3 !a !1 ?x',
    'aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa ababababababababab',
    'nul\u0000byte and del\u007F and bell\u0007',
    '<|endoftext|>Hello<|endoftext|> world <|endoftext|>',
    '<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n'
    '<|im_start|>assistant\nHello!<|im_end|>\n',
    '<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|>'
    '<|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|>',
    'partial: <|im_start| <|endoftext <|<|im_end|>|> <| im_end |> <|EOT_ID|>',
    'Hello <|endoftext|> there',
    # For the added tokens of the variants below.
    'Fill <mask> here, a  <mask>, <mask>ed, x<mask>',
    'a[SEP]   b [SEP]\n\nc [SEP]',
    'lathes lathe _lathe lathe1 (lathe) lathe. élathe lathe\u0301',
    'cafe\u0301 and café and e\u0301x and ex and <sep>  in <sep>',
    '',
    ' ',
    'a',
    '\n',
]


def random_lines(count):
    """Random lines over many Unicode blocks (letters, marks, digits, spaces, symbols, emoji,
    CJK, private use, unassigned and noncharacter code points) mixed with contractions,
    digits and special tokens: the character classes of the scanners, beyond hand-picked
    text. The generator (Park-Miller, as doubles) is the one the corpus was first made with,
    so the lines stay the same."""
    state = 20240601

    def next_random():
        nonlocal state
        state = (state * 48271) % 2147483647
        return state / 2147483647

    ranges = [
        (0x20, 0x7e), (0x20, 0x7e), (0x20, 0x7e), (0x0, 0x1f), (0x7f, 0x24f), (0x250, 0x36f),
        (0x370, 0x52f), (0x530, 0x6ff), (0x700, 0xdff), (0xe00, 0xfff), (0x1000, 0x11ff),
        (0x1200, 0x1fff), (0x2000, 0x206f), (0x2070, 0x218f), (0x2190, 0x2bff), (0x2c00, 0x2fff),
        (0x3000, 0x30ff), (0x3100, 0x4dff), (0x4e00, 0x9fff), (0xa000, 0xabff), (0xac00, 0xd7ff),
        (0xe000, 0xe0ff), (0xf900, 0xffff), (0x10000, 0x1ffff), (0x1f300, 0x1faff),
        (0x20000, 0x2ffff), (0xe0000, 0xe01ff), (0x10fff0, 0x10ffff),
    ]
    pieces = [' ', '  ', '\n', '\r\n', '\t', "'s", "'LL", "'ſ", '123', '45678', '\u00a0',
              '\u3000', '\u0085', '<|im_end|>', '<|eot_id|>', '<|endoftext|>']
    lines = []
    for _ in range(count):
        line = ''
        length = 1 + int(next_random() * 40)
        for _ in range(length):
            if next_random() < 0.25:
                line += pieces[int(next_random() * len(pieces))]
                continue
            low, high = ranges[int(next_random() * len(ranges))]
            c = low + int(next_random() * (high - low + 1))
            # No surrogates, and no code point that Unicode 16 assigned where the C++
            # splitter's ICU 72 (Unicode 15) has none: tokenizers 0.23's tables class it as a
            # letter, ICU as unassigned. The corpus met one, U+13A19 (Egyptian Hieroglyphs
            # Extended-A); the fixed seed meets no other.
            replaced = 0xd800 <= c <= 0xdfff or 0x13460 <= c <= 0x143ff
            line += chr(0x41 if replaced else c)
        lines.append(line)
    return lines


CORPUS += random_lines(32)


def variants(sizes):
    """A flavor's file with top-level fields replaced and added tokens appended."""
    return [
        {'name': 'gpt2', 'flavor': 'gpt2', 'patch': {}},
        {'name': 'llama3', 'flavor': 'llama3', 'patch': {}},
        {'name': 'qwen2', 'flavor': 'qwen2', 'patch': {}},
        {
            'name': 'gpt2-prefix-space',
            'flavor': 'gpt2',
            'patch': {
                'set': {
                    'pre_tokenizer': {'type': 'ByteLevel', 'add_prefix_space': True,
                                      'trim_offsets': True, 'use_regex': True},
                },
            },
        },
        {
            'name': 'gpt2-added-tokens',
            'flavor': 'gpt2',
            'patch': {
                'append_added_tokens': [
                    {'id': sizes['gpt2'], 'content': '<mask>', 'single_word': False,
                     'lstrip': True, 'rstrip': False, 'normalized': False, 'special': True},
                    {'id': sizes['gpt2'] + 1, 'content': '[SEP]', 'single_word': False,
                     'lstrip': False, 'rstrip': True, 'normalized': False, 'special': True},
                    {'id': sizes['gpt2'] + 2, 'content': 'lathe', 'single_word': True,
                     'lstrip': False, 'rstrip': False, 'normalized': True, 'special': False},
                    {'id': sizes['gpt2'] + 3, 'content': '<mask>ed', 'single_word': False,
                     'lstrip': False, 'rstrip': False, 'normalized': False, 'special': False},
                ],
            },
        },
        {
            'name': 'qwen2-added-tokens',
            'flavor': 'qwen2',
            'patch': {
                'append_added_tokens': [
                    {'id': sizes['qwen2'], 'content': 'café', 'single_word': False,
                     'lstrip': False, 'rstrip': False, 'normalized': True, 'special': False},
                    {'id': sizes['qwen2'] + 1, 'content': 'e\u0301x', 'single_word': False,
                     'lstrip': False, 'rstrip': False, 'normalized': False, 'special': False},
                    {'id': sizes['qwen2'] + 2, 'content': '<sep>', 'single_word': False,
                     'lstrip': True, 'rstrip': True, 'normalized': False, 'special': True},
                ],
            },
        },
    ]


def apply_patch(parsed, patch):
    result = copy.deepcopy(parsed)
    for key, value in patch.get('set', {}).items():
        result[key] = value
    result['added_tokens'].extend(copy.deepcopy(patch.get('append_added_tokens', [])))
    return result


def dump(value):
    """Compact JSON, non-ASCII characters as themselves (the layout of the file so far)."""
    return json.dumps(value, ensure_ascii=False, separators=(',', ':'))


def read_files(args):
    """The flavors' tokenizer.json bytes, from the given paths or from lathe-synth."""
    files = {}
    if args.lathe_synth:
        with tempfile.TemporaryDirectory(prefix='lathe-tok-') as tmp:
            for flavor in FLAVORS:
                out = os.path.join(tmp, flavor)
                subprocess.run([args.lathe_synth, 'tokenizer', '--flavor', flavor, '--out', out],
                               check=True, stdout=subprocess.DEVNULL)
                with open(os.path.join(out, 'tokenizer.json'), 'rb') as f:
                    files[flavor] = f.read()
    else:
        for flavor in FLAVORS:
            with open(getattr(args, flavor), 'rb') as f:
                files[flavor] = f.read()
    return files


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--lathe-synth', help='path to lathe-synth, run to write the files')
    for flavor in FLAVORS:
        parser.add_argument(f'--{flavor}', metavar='TOKENIZER_JSON',
                            help=f'tokenizer.json of `lathe-synth tokenizer --flavor {flavor}`')
    parser.add_argument('--output',
                        default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                             'tokenizer_expected.json'),
                        help='file to write (default: tokenizer_expected.json beside this script)')
    args = parser.parse_args()
    given = [flavor for flavor in FLAVORS if getattr(args, flavor)]
    if bool(args.lathe_synth) == bool(given) or (given and len(given) != len(FLAVORS)):
        parser.error('give either --lathe-synth or all of --gpt2, --llama3 and --qwen2')

    files = read_files(args)
    sha256 = {flavor: hashlib.sha256(text).hexdigest() for flavor, text in files.items()}
    parsed = {flavor: json.loads(text.decode('utf-8')) for flavor, text in files.items()}
    sizes = {flavor: max(t['id'] for t in p['added_tokens']) + 1 for flavor, p in parsed.items()}

    results = []
    for variant in variants(sizes):
        patched = apply_patch(parsed[variant['flavor']], variant['patch'])
        tokenizer = Tokenizer.from_str(json.dumps(patched))
        for token in patched['added_tokens']:
            # Hugging Face recomputes added token ids; they must agree with the file's.
            got = tokenizer.token_to_id(token['content'])
            if got != token['id']:
                sys.exit(f"{variant['name']}: {token['content']} has id {got}, "
                         f"the file says {token['id']}")
        ids = [tokenizer.encode(text, add_special_tokens=False).ids for text in CORPUS]
        ids_with_special_tokens = [
            tokenizer.encode(text, add_special_tokens=True).ids for text in CORPUS
        ]
        pre_tokens = None
        if variant['name'] == variant['flavor']:
            pre_tokens = [[piece for piece, _ in tokenizer.pre_tokenizer.pre_tokenize_str(text)]
                          for text in CORPUS]
        results.append((variant, ids, ids_with_special_tokens, pre_tokens))

    # One case per line keeps the file reviewable.
    lines = ['{']
    lines.append('  "generated_by": ' + dump(
        f'tests/engine/data/make_tokenizer_expected.py with tokenizers {tokenizers.__version__}')
                 + ',')
    lines.append('  "corpus": [')
    lines.append(',\n'.join('    ' + dump(text) for text in CORPUS))
    lines.append('  ],')
    lines.append('  "tokenizers": [')
    for index, (variant, ids, ids_with_special_tokens, pre_tokens) in enumerate(results):
        lines.append('    {')
        lines.append(f'      "name": {dump(variant["name"])},')
        lines.append(f'      "flavor": {dump(variant["flavor"])},')
        lines.append(f'      "sha256": {dump(sha256[variant["flavor"]])},')
        lines.append(f'      "patch": {dump(variant["patch"])},')
        lines.append('      "ids": [')
        lines.append(',\n'.join('        ' + dump(i) for i in ids))
        lines.append('      ],')
        lines.append('      "ids_with_special_tokens": [')
        lines.append(',\n'.join('        ' + dump(i) for i in ids_with_special_tokens))
        if pre_tokens is not None:
            lines.append('      ],')
            lines.append('      "pre_tokens": [')
            lines.append(',\n'.join('        ' + dump(p) for p in pre_tokens))
        lines.append('      ]')
        lines.append('    },' if index + 1 < len(results) else '    }')
    lines.append('  ]')
    lines.append('}')
    with open(args.output, 'w', encoding='utf-8', newline='\n') as f:
        f.write('\n'.join(lines) + '\n')
    print(f'wrote {args.output}: {len(results)} tokenizers x {len(CORPUS)} lines')


if __name__ == '__main__':
    main()
