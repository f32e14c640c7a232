/** Embeddings, rerank and score: request and response types, and the base64 decoding of an
 * embedding (little-endian float32, as OpenAI's SDKs read it). */
/** The floats of a base64 embedding (little-endian float32). */
export function decodeBase64Embedding(text) {
    const binary = atob(text);
    const view = new DataView(new ArrayBuffer(binary.length));
    for (let i = 0; i < binary.length; i++)
        view.setUint8(i, binary.charCodeAt(i));
    const out = [];
    for (let i = 0; i + 4 <= binary.length; i += 4)
        out.push(view.getFloat32(i, true));
    return out;
}
/** The response with every base64 embedding decoded. */
export function decodeEmbeddings(body) {
    for (const item of body.data) {
        if (typeof item.embedding === 'string')
            item.embedding = decodeBase64Embedding(item.embedding);
    }
    return body;
}
