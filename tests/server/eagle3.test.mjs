// `tandem serve` drafting with the bundled EAGLE-3 head (models/qwen35-demo-eagle3) on the demo
// model: concurrent clients at several temperatures each get exactly what `tandem generate` alone
// gives without a drafter, also when a later request restores an earlier one's prefix from the
// prefix cache; and the head's proposals are accepted under the server (a head that silently drew
// nothing acceptable would pass the equality checks alone).
import { test } from 'node:test';
import assert from 'node:assert/strict';
import fs from 'node:fs';
import path from 'node:path';
import { startServer, concurrentAndCachedEqualAlone, metrics, sourceDir } from './harness.mjs';

const head = path.join(sourceDir, 'models', 'qwen35-demo-eagle3');
const prompts = fs.readFileSync(path.join(sourceDir, 'models/qwen35-demo/prompts.jsonl'), 'utf8')
  .split('\n').filter(Boolean).map((l) => JSON.parse(l).prompt);

test('EAGLE-3: concurrent clients and prefix-cache hits equal plain tandem generate alone', async () => {
  const server = await startServer(['--draft', 'eagle3', '--draft-model', head, '--depth', '3',
                                    '--max-batch', '4', '--prefill-chunk', '16']);
  try {
    await concurrentAndCachedEqualAlone(server, { prompts, name: 'qwen35-demo', maxTokens: (i) => 16 + (i * 7) % 24,
                                                  seed: (i) => 900 + i });
    const m = await metrics(server.url);
    const count = (name) => Object.entries(m).filter(([k]) => k.startsWith(name + '{drafter="eagle3"'))
      .reduce((s, [, v]) => s + v, 0);
    const drafted = count('tandem_draft_tokens_total'), accepted = count('tandem_accepted_tokens_total');
    assert.ok(drafted > 0, JSON.stringify(m));
    // The head accepts ~80% of its first proposals on this model; a quarter is far below that.
    assert.ok(accepted > 0.25 * drafted, `accepted ${accepted} of ${drafted} proposals`);
    assert.ok(m['tandem_prefix_cache_requests_total{tier="memory",result="hit"}'] >= 6, JSON.stringify(m));
  } finally {
    const { code } = await server.stop();
    assert.equal(code, 0, server.log());
  }
});
