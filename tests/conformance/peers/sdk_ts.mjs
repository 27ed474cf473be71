// Conformance peer: the TypeScript MCP SDK 1.32 (McpServer + server.experimental.tasks.registerToolTask,
// InMemoryTaskStore + InMemoryTaskMessageQueue) over Streamable HTTP, stateful, SSE answers.
//
//   node sdk_ts.mjs --port N --sdk-dir ~/.cache/longcall-peers/sdk-ts-1.32
//
// The SDK lives where scripts/install-peers put it (--sdk-dir); ES modules do not search NODE_PATH,
// so the modules are imported by file URL. One McpServer per session (the SDK binds a server to one
// transport); the task store and message queue are shared and bind each task to its session.
import { randomUUID } from 'node:crypto';
import { createServer } from 'node:http';
import { join } from 'node:path';
import { pathToFileURL } from 'node:url';
import { parseArgs } from 'node:util';

const { values: options } = parseArgs({
  options: {
    port: { type: 'string' },
    host: { type: 'string', default: '127.0.0.1' },
    'sdk-dir': { type: 'string' },
  },
});
if (!options.port || !options['sdk-dir']) {
  console.error('usage: node sdk_ts.mjs --port N --sdk-dir DIR');
  process.exit(2);
}
const modules = join(options['sdk-dir'], 'node_modules');
const load = (path) => import(pathToFileURL(join(modules, path)).href);
const { McpServer } = await load('@modelcontextprotocol/sdk/dist/esm/server/mcp.js');
const { StreamableHTTPServerTransport } = await load('@modelcontextprotocol/sdk/dist/esm/server/streamableHttp.js');
const { InMemoryTaskStore, InMemoryTaskMessageQueue } = await load(
  '@modelcontextprotocol/sdk/dist/esm/experimental/tasks/stores/in-memory.js',
);
const { isInitializeRequest } = await load('@modelcontextprotocol/sdk/dist/esm/types.js');
const { z } = await load('zod/index.js');

const taskStore = new InMemoryTaskStore();
const taskMessageQueue = new InMemoryTaskMessageQueue();
const APPROVAL_SCHEMA = {
  type: 'object',
  properties: { approved: { type: 'boolean' } },
  required: ['approved'],
};
const text = (value, isError = false) => ({ content: [{ type: 'text', text: value }], isError });
const terminal = (status) => status === 'completed' || status === 'failed' || status === 'cancelled';
// Python's f"{x:g}" for the numbers the tests use: 2 -> "2", 0.5 -> "0.5".
const formatSeconds = (seconds) => String(Number(seconds.toPrecision(6)));

async function finish(store, taskId, result) {
  // A cancelled task stays cancelled: the store refuses a late result, which is what we want.
  try {
    await store.storeTaskResult(taskId, result.isError ? 'failed' : 'completed', result);
  } catch {
    /* terminal already */
  }
}

async function sleepUnlessCancelled(store, taskId, seconds) {
  const deadline = Date.now() + seconds * 1000;
  while (Date.now() < deadline) {
    await new Promise((resolve) => setTimeout(resolve, Math.min(100, deadline - Date.now())));
    const task = await store.getTask(taskId).catch(() => null);
    if (!task || terminal(task.status)) return false;
  }
  return true;
}

function buildServer() {
  const server = new McpServer(
    { name: 'longcall-peer-sdk-ts-1.32', version: '1.32.2' },
    {
      capabilities: { tasks: { list: {}, cancel: {}, requests: { tools: { call: {} } } } },
      taskStore,
      taskMessageQueue,
    },
  );
  const taskParams = (extra) => ({ ttl: extra.taskRequestedTtl ?? null, pollInterval: 500 });
  const readTask = (args, extra) => extra.taskStore.getTask(extra.taskId);
  const readResult = (args, extra) => extra.taskStore.getTaskResult(extra.taskId);

  server.experimental.tasks.registerToolTask(
    'slow_report',
    {
      description: 'Builds a report slowly: sleeps `seconds`, then answers (isError when `fail`).',
      inputSchema: { seconds: z.number().min(0), fail: z.boolean().default(false) },
      execution: { taskSupport: 'optional' },
    },
    {
      createTask: async ({ seconds, fail }, extra) => {
        const store = extra.taskStore;
        const task = await store.createTask(taskParams(extra));
        (async () => {
          if (await sleepUnlessCancelled(store, task.taskId, seconds)) {
            await finish(store, task.taskId, text(`report ready after ${formatSeconds(seconds)}s`, fail));
          }
        })();
        return { task: { ...task } }; // the store hands out its live object
      },
      getTask: readTask,
      getTaskResult: readResult,
    },
  );

  server.registerTool(
    'quick_lookup',
    { description: 'Looks a key up at once (no task support).', inputSchema: { key: z.string() } },
    async ({ key }) => text(`value:${key}`),
  );

  server.experimental.tasks.registerToolTask(
    'ask_approval',
    {
      description: 'Asks the client to approve `question` (elicitation) and answers approved/declined.',
      inputSchema: { question: z.string() },
      execution: { taskSupport: 'required' },
    },
    {
      createTask: async ({ question }, extra) => {
        const store = extra.taskStore;
        const task = await store.createTask(taskParams(extra));
        (async () => {
          let answer;
          try {
            await store.updateTaskStatus(task.taskId, 'input_required');
            // relatedTask queues the request for delivery on the tasks/result stream.
            answer = await server.server.elicitInput(
              { mode: 'form', message: question, requestedSchema: APPROVAL_SCHEMA },
              { relatedTask: { taskId: task.taskId }, timeout: 3_600_000 },
            );
            await store.updateTaskStatus(task.taskId, 'working');
          } catch (error) {
            await finish(store, task.taskId, text(String(error?.message ?? error), true));
            return;
          }
          const approved = answer.action === 'accept' && answer.content?.approved === true;
          await finish(store, task.taskId, text(approved ? 'approved' : 'declined'));
        })();
        return { task: { ...task } }; // the store hands out its live object
      },
      getTask: readTask,
      getTaskResult: readResult,
    },
  );
  return server;
}

const transports = new Map();

function transportError(res, status, message) {
  res.writeHead(status, { 'content-type': 'application/json' });
  res.end(JSON.stringify({ jsonrpc: '2.0', error: { code: -32000, message }, id: null }));
}

async function readJson(req) {
  const chunks = [];
  for await (const chunk of req) chunks.push(chunk);
  const raw = Buffer.concat(chunks).toString('utf8');
  return raw ? JSON.parse(raw) : undefined;
}

const http = createServer(async (req, res) => {
  try {
    const url = new URL(req.url, 'http://localhost');
    if (url.pathname.replace(/\/$/, '') !== '/mcp') {
      res.writeHead(404).end('Not Found');
      return;
    }
    const body = req.method === 'POST' ? await readJson(req) : undefined;
    const sessionId = req.headers['mcp-session-id'];
    let transport = sessionId ? transports.get(sessionId) : undefined;
    if (!transport && req.method === 'POST' && !sessionId && isInitializeRequest(body)) {
      transport = new StreamableHTTPServerTransport({
        sessionIdGenerator: () => randomUUID(),
        onsessioninitialized: (id) => transports.set(id, transport),
      });
      transport.onclose = () => transport.sessionId && transports.delete(transport.sessionId);
      await buildServer().connect(transport);
    }
    if (!transport) {
      if (sessionId) transportError(res, 404, 'Session not found');
      else transportError(res, 400, 'Bad Request: Missing session ID');
      return;
    }
    await transport.handleRequest(req, res, body);
  } catch (error) {
    if (!res.headersSent) transportError(res, 500, String(error?.message ?? error));
    else res.end();
  }
});

http.listen(Number(options.port), options.host);
for (const signal of ['SIGTERM', 'SIGINT']) {
  process.on(signal, () => {
    http.close();
    http.closeAllConnections();
    process.exit(0);
  });
}
