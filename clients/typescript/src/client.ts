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

  /** Stream a completion of one embeddings prompt; calls onDelta for every delta, resolves with the whole. */
  streamComplete(
    model: string,
    tensor: ReturnType<typeof float32Tensor>,
    sampling: Sampling,
    onDelta: (d: Delta) => void = () => {},
  ): Promise<CompletionResult> {
    const params = { model, promptEmbeds: [{ tensor }], sampling };
    return new Promise((resolve, reject) => {
      const result: CompletionResult = {
        text: [],
        finishReasons: [],
        usage: { promptTokens: 0, completionTokens: 0, totalTokens: 0 },
      };
      const call = this.stub.StreamComplete({ params });
      call.on("data", (msg: any) => {
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
