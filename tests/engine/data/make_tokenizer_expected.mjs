// Writes tokenizer_expected.json: the ids that Hugging Face's own tokenizer (the Rust
// `tokenizers` library, through its Node binding) gives for a test corpus, with each of the
// synthetic tokenizers that `lathe-synth tokenizer` writes and a few variants of them.
// tests/engine/tokenizer_test.cc regenerates the same tokenizers, checks their SHA-256
// against the one recorded here, and expects Lathe's Tokenizer to give the same ids. For the
// three flavors it also records the pre-tokens (byte-level form) that each one's
// pre-tokenizer alone gives, which tests the regex scanners without the merges in the way.
//
// Run once, when the generator, the corpus or the variants change (CI does not run it):
//   mkdir -p /tmp/hftok && (cd /tmp/hftok &&
//     npm install tokenizers@0.13.3 tokenizers-linux-x64-gnu@0.13.4-rc2)
//   NODE_PATH=/tmp/hftok/node_modules node tests/engine/data/make_tokenizer_expected.mjs \
//     build/bin/lathe-synth
//
// That release predates `ignore_merges` and merges written as pairs, so the files here use
// neither; the C++ tests cover those with small hand-made tokenizers.
import {execFileSync} from 'node:child_process';
import {createHash} from 'node:crypto';
import {mkdtempSync, readFileSync, rmSync, writeFileSync} from 'node:fs';
import {createRequire} from 'node:module';
import {tmpdir} from 'node:os';
import {dirname, join} from 'node:path';
import {fileURLToPath} from 'node:url';

const require = createRequire(import.meta.url);
const {Tokenizer} = require('tokenizers');
const tokenizersVersion = require('tokenizers-linux-x64-gnu/package.json').version;

const synth = process.argv[2];
if (!synth) {
  console.error('usage: make_tokenizer_expected.mjs <path to lathe-synth>');
  process.exit(2);
}
const here = dirname(fileURLToPath(import.meta.url));

// Every line is encoded with and without the post-processor's special tokens.
const corpus = [
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
  // NFC-sensitive: decomposed accents, Hangul jamo, a mark after a dotted letter.
  'cafe\u0301 vs café; A\u030Angstro\u0308m; man\u0303ana; \u1E9B\u0323; \u1100\u1161\u11A8',
  '\u0301starts with a mark, then a mark alone: \u0301 and x\u0301\u0301',
  'two  spaces   three    four     five',
  'tab\there\t\tdouble tab \t mixed',
  'line1\nline2\n\nline4\r\nwindows\r\n\r\nend\rcr',
  'trailing spaces   ',
  '   leading spaces',
  '\n\n\nleading newlines',
  ' \n \n mixed \t\n whitespace \n',
  'nbsp\u00A0here ideographic\u3000space thin\u2009space nel\u0085line ls\u2028ps\u2029 vt\u000Bff\u000C fs\u001Cgs\u001D',
  'zero\u200Bwidth\u200Cnon\u200Djoiner\uFEFFbom \uE000 \uFFFD',
  'for (int i = 0; i < n; ++i) { total += w[i] * x[i]; }',
  '{"text": "hello", "ids": [1, 2, 3], "ok": true}',
  'https://example.com/a?b=c&d=e user@example.org #tag @name',
  '!!! ??? ... --- === *** ###\n\n!!!\n?!\r\n',
  'abc123def 456ghi 12abc a1b2c3 !a !1 ?x',
  'aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa ababababababababab',
  'nul\u0000byte and del\u007F and bell\u0007',
  '<|endoftext|>Hello<|endoftext|> world <|endoftext|>',
  '<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n',
  '<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|>',
  'partial: <|im_start| <|endoftext <|<|im_end|>|> <| im_end |> <|EOT_ID|>',
  'Hello <|endoftext|> there',
  // For the added tokens of the variants below.
  'Fill <mask> here, a  <mask>, <mask>ed, x<mask>',
  'a[SEP]   b [SEP]\n\nc [SEP]',
  'lathes lathe _lathe lathe1 (lathe) lathe. élathe lathe\u0301',
  'cafe\u0301 and café and e\u0301x and ex and <sep>  in <sep>',
  '',
  ' ',
  'a',
  '\n',
];

// Random lines over many Unicode blocks (letters, marks, digits, spaces, symbols, emoji,
// CJK, private use, unassigned and noncharacter code points) mixed with contractions,
// digits and special tokens: the character classes of the scanners, beyond hand-picked text.
function randomLines(count) {
  let state = 20240601;
  const next = () => (state = (state * 48271) % 2147483647) / 2147483647;
  const ranges = [
    [0x20, 0x7e], [0x20, 0x7e], [0x20, 0x7e], [0x0, 0x1f], [0x7f, 0x24f], [0x250, 0x36f],
    [0x370, 0x52f], [0x530, 0x6ff], [0x700, 0xdff], [0xe00, 0xfff], [0x1000, 0x11ff],
    [0x1200, 0x1fff], [0x2000, 0x206f], [0x2070, 0x218f], [0x2190, 0x2bff], [0x2c00, 0x2fff],
    [0x3000, 0x30ff], [0x3100, 0x4dff], [0x4e00, 0x9fff], [0xa000, 0xabff], [0xac00, 0xd7ff],
    [0xe000, 0xe0ff], [0xf900, 0xffff], [0x10000, 0x1ffff], [0x1f300, 0x1faff],
    [0x20000, 0x2ffff], [0xe0000, 0xe01ff], [0x10fff0, 0x10ffff],
  ];
  const pieces = [' ', '  ', '\n', '\r\n', '\t', "'s", "'LL", "'ſ", '123', '45678', '\u00a0',
                  '\u3000', '\u0085', '<|im_end|>', '<|eot_id|>', '<|endoftext|>'];
  const lines = [];
  for (let l = 0; l < count; ++l) {
    let line = '';
    const length = 1 + Math.floor(next() * 40);
    for (let i = 0; i < length; ++i) {
      if (next() < 0.25) {
        line += pieces[Math.floor(next() * pieces.length)];
        continue;
      }
      const [low, high] = ranges[Math.floor(next() * ranges.length)];
      const c = low + Math.floor(next() * (high - low + 1));
      line += String.fromCodePoint(c >= 0xd800 && c <= 0xdfff ? 0x41 : c);  // no surrogates
    }
    lines.push(line);
  }
  return lines;
}
corpus.push(...randomLines(32));

// Variants: a flavor's file with top-level fields replaced and added tokens appended.
function variants(sizes) {
  return [
    {name: 'gpt2', flavor: 'gpt2', patch: {}},
    {name: 'llama3', flavor: 'llama3', patch: {}},
    {name: 'qwen2', flavor: 'qwen2', patch: {}},
    {
      name: 'gpt2-prefix-space',
      flavor: 'gpt2',
      patch: {
        set: {
          pre_tokenizer:
              {type: 'ByteLevel', add_prefix_space: true, trim_offsets: true, use_regex: true},
        },
      },
    },
    {
      name: 'gpt2-added-tokens',
      flavor: 'gpt2',
      patch: {
        append_added_tokens: [
          {id: sizes.gpt2, content: '<mask>', single_word: false, lstrip: true, rstrip: false,
           normalized: false, special: true},
          {id: sizes.gpt2 + 1, content: '[SEP]', single_word: false, lstrip: false, rstrip: true,
           normalized: false, special: true},
          {id: sizes.gpt2 + 2, content: 'lathe', single_word: true, lstrip: false, rstrip: false,
           normalized: true, special: false},
          {id: sizes.gpt2 + 3, content: '<mask>ed', single_word: false, lstrip: false,
           rstrip: false, normalized: false, special: false},
        ],
      },
    },
    {
      name: 'qwen2-added-tokens',
      flavor: 'qwen2',
      patch: {
        append_added_tokens: [
          {id: sizes.qwen2, content: 'café', single_word: false, lstrip: false, rstrip: false,
           normalized: true, special: false},
          {id: sizes.qwen2 + 1, content: 'e\u0301x', single_word: false, lstrip: false,
           rstrip: false, normalized: false, special: false},
          {id: sizes.qwen2 + 2, content: '<sep>', single_word: false, lstrip: true, rstrip: true,
           normalized: false, special: true},
        ],
      },
    },
  ];
}

function applyPatch(json, patch) {
  const copy = JSON.parse(JSON.stringify(json));
  for (const [key, value] of Object.entries(patch.set ?? {})) copy[key] = value;
  copy.added_tokens.push(...(patch.append_added_tokens ?? []));
  return copy;
}

const dir = mkdtempSync(join(tmpdir(), 'lathe-tok-'));
const files = {};
const sizes = {};
for (const flavor of ['gpt2', 'llama3', 'qwen2']) {
  const out = join(dir, flavor);
  execFileSync(synth, ['tokenizer', '--flavor', flavor, '--out', out]);
  const text = readFileSync(join(out, 'tokenizer.json'));
  files[flavor] = {text, sha256: createHash('sha256').update(text).digest('hex')};
  const json = JSON.parse(text.toString('utf8'));
  sizes[flavor] = Math.max(...json.added_tokens.map((t) => t.id)) + 1;
}
rmSync(dir, {recursive: true});

const results = [];
for (const variant of variants(sizes)) {
  const json = applyPatch(JSON.parse(files[variant.flavor].text.toString('utf8')), variant.patch);
  const tokenizer = Tokenizer.fromString(JSON.stringify(json));
  for (const token of json.added_tokens) {
    // Hugging Face recomputes added token ids; they must agree with the file's.
    if (tokenizer.tokenToId(token.content) !== token.id) {
      throw new Error(`${variant.name}: ${token.content} has id ${
          tokenizer.tokenToId(token.content)}, the file says ${token.id}`);
    }
  }
  const ids = [];
  const idsWithSpecialTokens = [];
  for (const text of corpus) {
    ids.push((await tokenizer.encode(text, null, {addSpecialTokens: false})).getIds());
    idsWithSpecialTokens.push(
        (await tokenizer.encode(text, null, {addSpecialTokens: true})).getIds());
  }
  const preTokens = variant.name === variant.flavor ?
      corpus.map((text) => tokenizer.getPreTokenizer().preTokenizeString(text).map((p) => p[0])) :
      null;
  results.push(
      {variant, sha256: files[variant.flavor].sha256, ids, idsWithSpecialTokens, preTokens});
}

// One case per line keeps the file reviewable.
const lines = [];
lines.push('{');
lines.push(`  "generated_by": ${JSON.stringify(
    `tests/engine/data/make_tokenizer_expected.mjs with tokenizers-linux-x64-gnu ${
        tokenizersVersion}`)},`);
lines.push('  "corpus": [');
lines.push(corpus.map((text) => '    ' + JSON.stringify(text)).join(',\n'));
lines.push('  ],');
lines.push('  "tokenizers": [');
results.forEach((r, index) => {
  lines.push('    {');
  lines.push(`      "name": ${JSON.stringify(r.variant.name)},`);
  lines.push(`      "flavor": ${JSON.stringify(r.variant.flavor)},`);
  lines.push(`      "sha256": ${JSON.stringify(r.sha256)},`);
  lines.push(`      "patch": ${JSON.stringify(r.variant.patch)},`);
  lines.push('      "ids": [');
  lines.push(r.ids.map((ids) => '        ' + JSON.stringify(ids)).join(',\n'));
  lines.push('      ],');
  lines.push('      "ids_with_special_tokens": [');
  lines.push(r.idsWithSpecialTokens.map((ids) => '        ' + JSON.stringify(ids)).join(',\n'));
  if (r.preTokens) {
    lines.push('      ],');
    lines.push('      "pre_tokens": [');
    lines.push(r.preTokens.map((p) => '        ' + JSON.stringify(p)).join(',\n'));
  }
  lines.push('      ]');
  lines.push(index + 1 < results.length ? '    },' : '    }');
});
lines.push('  ]');
lines.push('}');
const output = join(here, 'tokenizer_expected.json');
writeFileSync(output, lines.join('\n') + '\n');
console.log(`wrote ${output}: ${results.length} tokenizers x ${corpus.length} lines`);
