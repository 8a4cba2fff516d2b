// embedmesh's TypeScript client, loaded from the same protos/ as every other client (no copies).
// Prompt embeddings travel as raw little-endian bytes in a Tensor message: no base64, no pickle.
import path from "node:path";
import { fileURLToPath } from "node:url";
import * as grpc from "@grpc/grpc-js";
import * as protoLoader from "@grpc/proto-loader";

const here = path.dirname(fileURLToPath(import.meta.url));
/** protos/ at the repository root (override with EMBEDMESH_PROTOS). */
export const PROTOS = process.env.EMBEDMESH_PROTOS ?? path.resolve(here, "../../../protos");

export interface Sampling {
  maxTokens?: number;
  temperature?: number;
  topP?: number;
  seed?: number;
  stop?: string[];
}

export interface Delta {
  index: number;
  text: string;
  finishReason: string;
}

export interface CompletionResult {
  text: string[];
  finishReasons: string[];
  usage: { promptTokens: number; completionTokens: number; totalTokens: number };
}

/** A served model as ListModels describes it (every field of the proto's Model message). */
export interface Model {
  /** Name to pass as `model`; for a LoRA adapter, the name it was loaded under. */
  id: string;
  /** For a LoRA adapter: the base model it applies to; "" for a base model. */
  parent: string;
  /** Hidden size prompt embeddings must have. */
  hiddenSize: number;
  /** Context length in positions (prompt + generated). */
  maxContextTokens: number;
  /** Element type prompt embeddings are cast to, as the proto enum's name (e.g. "DATA_TYPE_FP32"). */
  dtype: string;
  /** Engines serving it (e.g. "hf"). */
  engines: string[];
  /** "generate" or "embed". */
  task: string;
  /** Length of the vectors an embedding model returns (0 for generative models). */
  embeddingSize: number;
  /** Healthy workers serving it (for an adapter: workers holding it). */
  readyWorkers: number;
  /** Unix seconds when the mesh first saw it. */
  created: number;
}

const FINISH: Record<string, string> = {
  FINISH_REASON_LENGTH: "length",
  FINISH_REASON_STOP: "stop",
  FINISH_REASON_ABORT: "abort",
};

function loadService(): grpc.ServiceClientConstructor {
  const definition = protoLoader.loadSync("embedmesh/inference/v1/inference.proto", {
    includeDirs: [PROTOS],
    keepCase: false,
    longs: Number,
    enums: String,
    defaults: true,
    oneofs: true,
  });
  const pkg = grpc.loadPackageDefinition(definition) as any;
  return pkg.embedmesh.inference.v1.InferenceService as grpc.ServiceClientConstructor;
}

/** A (rows, hidden) float32 tensor as the mesh's Tensor message: the bytes of the array, as they are. */
export function float32Tensor(values: Float32Array, rows: number, hidden: number) {
  if (values.length !== rows * hidden) throw new Error(`expected ${rows * hidden} floats, got ${values.length}`);
  return {
    dtype: "DATA_TYPE_FP32",
    shape: [rows, hidden],
    data: Buffer.from(values.buffer, values.byteOffset, values.byteLength),
  };
}

/** Tensors of this many bytes or more go as rows after the Generate header: no message size limit to raise.
 * Smaller ones go inside the header, one GenerateInline message (a unary request: less work for both sides). */
export const CHUNKED_MIN = 1 << 20;
const CHUNK_BYTES = 1 << 20;

export class EmbedmeshClient {
  private readonly stub: any;

  constructor(address: string, credentials: grpc.ChannelCredentials = grpc.credentials.createInsecure()) {
    const Service = loadService();
    this.stub = new Service(address, credentials, {
      "grpc.max_send_message_length": 512 * 1024 * 1024,
      "grpc.max_receive_message_length": 512 * 1024 * 1024,
    });
  }

  close(): void {
    this.stub.close();
  }

  /** Models the mesh serves (InferenceService.ListModels): base models and loaded LoRA adapters (parent set). */
  listModels(): Promise<Model[]> {
    return new Promise((resolve, reject) => {
      this.stub.ListModels({}, (err: grpc.ServiceError | null, resp: any) => {
        if (err) return reject(err);
        resolve((resp?.models ?? []).map((m: any): Model => ({
          id: m.id,
          parent: m.parent,
          hiddenSize: Number(m.hiddenSize),
          maxContextTokens: Number(m.maxContextTokens),
          dtype: m.dtype,
          engines: [...(m.engines ?? [])],
          task: m.task,
          embeddingSize: Number(m.embeddingSize),
          readyWorkers: Number(m.readyWorkers),
          created: Number(m.created),
        })));
      });
    });
  }

  /** Stream a completion of one embeddings prompt; calls onDelta for every delta, resolves with the whole.
   * `model` is any id listModels() returns: a base model, or a loaded LoRA adapter's name. One call: a tensor of
   * CHUNKED_MIN bytes or more goes as rows after the header of an InferenceService.Generate stream (in 1 MiB
   * pieces), a smaller one inside the header of one InferenceService.GenerateInline message. */
  streamComplete(
    model: string,
    tensor: ReturnType<typeof float32Tensor>,
    sampling: Sampling,
    onDelta: (d: Delta) => void = () => {},
  ): Promise<CompletionResult> {
    return new Promise((resolve, reject) => {
      const result: CompletionResult = {
        text: [],
        finishReasons: [],
        usage: { promptTokens: 0, completionTokens: 0, totalTokens: 0 },
      };
      const header = (t: object) => ({
        request: { completion: { model, promptEmbeds: [{ tensor: t }], sampling }, stream: true },
      });
      let call: any;
      if (tensor.data.length >= CHUNKED_MIN) {
        call = this.stub.Generate();
        call.write(header({ dtype: tensor.dtype, shape: tensor.shape }));
        for (let i = 0; i < tensor.data.length; i += CHUNK_BYTES) {
          call.write({ rows: tensor.data.subarray(i, i + CHUNK_BYTES) });
        }
        call.end();
      } else {
        call = this.stub.GenerateInline(header(tensor));
      }
      call.on("data", (event: any) => {
        const msg = event.completionChunk;
        if (!msg) return;
        if (msg.usage) {
          result.usage = msg.usage;
          return;
        }
        const finish = FINISH[msg.finishReason] ?? "";
        result.text[msg.index] = (result.text[msg.index] ?? "") + msg.text;
        if (finish) result.finishReasons[msg.index] = finish;
        onDelta({ index: msg.index, text: msg.text, finishReason: finish });
      });
      call.on("error", (err: grpc.ServiceError) => reject(err));
      call.on("end", () => resolve(result));
    });
  }
}
