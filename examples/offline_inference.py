"""Offline batch generation and chat with the embedded default model (SmolLM2-135M-Instruct).

python examples/offline_inference.py
"""

from pagedlm import LLM, SamplingParams


def main() -> None:
    llm = LLM()  # no model given: the embedded SmolLM2-135M-Instruct GGUF

    answer = llm.chat(
        [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
        SamplingParams(temperature=0, max_tokens=32),
    )[0]
    print("chat:", answer.outputs[0].text.strip())

    prompts = ["The three primary colors are", "A haiku about the sea:", "def fibonacci(n):"]
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=48, seed=0)
    for out in llm.generate(prompts, params):
        print(f"\n--- {out.prompt!r}\n{out.outputs[0].text}")


if __name__ == "__main__":
    main()
